package main

// Certificates and keys for a throwaway cluster: one CA, the API server's serving certificate,
// an admin client certificate (group system:masters), the front proxy's client certificate (the
// aggregation layer's: the API server proxies to an extension API server, such as KEDA's metrics
// adapter, as front-proxy-client, the only name its request-header authentication accepts) and
// the service-account signing key. Kept under <dir>/pki and reused when the directory is reused.

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

type pkiPaths struct {
	caCert, caKey         string
	serverCert, serverKey string
	adminCert, adminKey   string
	proxyCert, proxyKey   string
	saKey, saPub          string
}

// ensurePKI makes the CA and certificates once per state directory; sans are the serving
// certificate's IP addresses (loopback, the bind address, the first Service IP).
func ensurePKI(dir string, sans []net.IP) (pkiPaths, error) {
	p := pkiPaths{
		caCert: filepath.Join(dir, "ca.crt"), caKey: filepath.Join(dir, "ca.key"),
		serverCert: filepath.Join(dir, "apiserver.crt"), serverKey: filepath.Join(dir, "apiserver.key"),
		adminCert: filepath.Join(dir, "admin.crt"), adminKey: filepath.Join(dir, "admin.key"),
		proxyCert: filepath.Join(dir, "front-proxy-client.crt"), proxyKey: filepath.Join(dir, "front-proxy-client.key"),
		saKey: filepath.Join(dir, "sa.key"), saPub: filepath.Join(dir, "sa.pub"),
	}
	if _, err := os.Stat(p.saPub); err == nil {
		if _, err := os.Stat(p.proxyKey); err == nil {
			return p, nil // made by an earlier run on this directory (one older than the front proxy: again)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return p, err
	}
	now := time.Now().Add(-time.Hour)
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return p, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kvscale-test-ca"},
		NotBefore:             now,
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return p, err
	}
	ca, _ := x509.ParseCertificate(caDER)
	if err := writeCertAndKey(p.caCert, p.caKey, caDER, caKey); err != nil {
		return p, err
	}

	serving := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now,
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		IPAddresses:  sans,
	}
	if err := issue(p.serverCert, p.serverKey, serving, ca, caKey); err != nil {
		return p, err
	}
	admin := &x509.Certificate{
		SerialNumber: big.NewInt(3),
		Subject:      pkix.Name{CommonName: "kvscale-admin", Organization: []string{"system:masters"}},
		NotBefore:    now,
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if err := issue(p.adminCert, p.adminKey, admin, ca, caKey); err != nil {
		return p, err
	}
	// Signed by the one CA (a real cluster has a front-proxy CA of its own): the API server
	// accepts request headers only from a client certificate named front-proxy-client.
	proxy := &x509.Certificate{
		SerialNumber: big.NewInt(4),
		Subject:      pkix.Name{CommonName: "front-proxy-client"},
		NotBefore:    now,
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if err := issue(p.proxyCert, p.proxyKey, proxy, ca, caKey); err != nil {
		return p, err
	}

	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return p, err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return p, err
	}
	if err := writePEM(p.saKey, "RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(saKey)); err != nil {
		return p, err
	}
	return p, writePEM(p.saPub, "PUBLIC KEY", pubDER)
}

func issue(certPath, keyPath string, tmpl, ca *x509.Certificate, caKey crypto.Signer) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return err
	}
	return writeCertAndKey(certPath, keyPath, der, key)
}

func writeCertAndKey(certPath, keyPath string, der []byte, key *ecdsa.PrivateKey) error {
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := writePEM(certPath, "CERTIFICATE", der); err != nil {
		return err
	}
	return writePEM(keyPath, "EC PRIVATE KEY", keyDER)
}

func writePEM(path, kind string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600)
}

func loadCertPool(path string) (*x509.CertPool, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, errors.New("no certificate in " + path)
	}
	return pool, nil
}

// writeKubeconfig writes an admin kubeconfig with the certificates inlined, so it stays valid
// wherever it is copied.
func writeKubeconfig(path, server string, p pkiPaths) error {
	b64 := func(file string) (string, error) {
		data, err := os.ReadFile(file)
		return base64.StdEncoding.EncodeToString(data), err
	}
	ca, err := b64(p.caCert)
	if err != nil {
		return err
	}
	cert, err := b64(p.adminCert)
	if err != nil {
		return err
	}
	key, err := b64(p.adminKey)
	if err != nil {
		return err
	}
	config := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: kvscale-local
  cluster:
    server: %s
    certificate-authority-data: %s
users:
- name: kvscale-admin
  user:
    client-certificate-data: %s
    client-key-data: %s
contexts:
- name: kvscale-local
  context:
    cluster: kvscale-local
    user: kvscale-admin
current-context: kvscale-local
`, server, ca, cert, key)
	return os.WriteFile(path, []byte(config), 0o600)
}
