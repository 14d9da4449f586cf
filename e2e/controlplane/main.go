// kvscale-controlplane: a real Kubernetes control plane in one process, for tests.
//
// It starts, in-process and built from the upstream Go modules of one release: etcd (embedded,
// data under --dir), kube-apiserver (secure port on 127.0.0.1, its own CA, serving and admin
// client certificates, RBAC and Node authorisation, service-account token signing) and
// kube-controller-manager (the controllers a Deployment / Service / PDB / HPA / PVC needs). No
// scheduler and no kubelet here: the Python harness (e2e/cluster.py, e2e/realnode.py) runs them,
// built from the same module set. With --address set to an address pods can reach (the test
// node's bridge), the API server binds and advertises it, reconciles the `kubernetes` Service's
// endpoint and carries it and the first Service IP in its certificate, so pods can use it. An IPv6
// --address with an IPv6-first --service-cidr pair makes an IPv6-first dual-stack cluster.
//
// When everything answers it writes an admin kubeconfig and prints one line,
//
//	KVSCALE_CONTROLPLANE_READY kubeconfig=<path> server=<url>
//
// and on SIGTERM or SIGINT it stops the controllers, the API server and etcd, then exits 0.
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/klog/v2"
	apiserverapp "k8s.io/kubernetes/cmd/kube-apiserver/app"
	apiserveroptions "k8s.io/kubernetes/cmd/kube-apiserver/app/options"
	kcmapp "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	kcmoptions "k8s.io/kubernetes/cmd/kube-controller-manager/app/options"
)

// The controllers our operator and its tests rely on; node lifecycle, scheduling-related and
// cloud controllers stay off (with no kubelet they would only taint and evict).
var controllers = []string{
	"deployment-controller",
	"replicaset-controller",
	"garbage-collector-controller",
	"serviceaccount-controller",
	"serviceaccount-token-controller",
	"endpoints-controller",
	"endpointslice-controller",
	"namespace-controller",
	"disruption-controller",
	"horizontal-pod-autoscaler-controller",
	"clusterrole-aggregation-controller", // fills edit/view with manifests/user-roles.yaml's rules
	"root-ca-certificate-publisher-controller",
	"pod-garbage-collector-controller",
	"persistentvolume-binder-controller",
	"persistentvolume-protection-controller",
	"persistentvolumeclaim-protection-controller",
	"statefulset-controller", // LeaderWorkerSet groups: a StatefulSet of leaders, one of workers per group (e2e/test_parallelism.py)
}

// With a real kubelet (--node-lifecycle): the controller that lifts the node's not-ready taint
// once the kubelet reports Ready (and taints a node whose kubelet stops reporting).
var nodeControllers = []string{"node-lifecycle-controller"}

func main() {
	dir := flag.String("dir", "", "state directory (etcd data, certificates, kubeconfig); created if missing")
	port := flag.Int("port", 0, "kube-apiserver secure port (0: a free one)")
	address := flag.String("address", "127.0.0.1", "kube-apiserver bind and advertise address")
	serviceCIDR := flag.String("service-cidr", "10.96.0.0/16", "the Service ClusterIP range (two, comma-separated, of different families: dual-stack, the first primary)")
	nodeLifecycle := flag.Bool("node-lifecycle", false, "also run the node-lifecycle controller (a real kubelet)")
	verbosity := flag.Int("v", 0, "log verbosity of the Kubernetes components")
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "--dir is required")
		os.Exit(2)
	}
	o := options{address: *address, serviceCIDR: *serviceCIDR, nodeLifecycle: *nodeLifecycle, verbosity: *verbosity}
	if err := run(*dir, *port, o); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

type options struct {
	address, serviceCIDR string
	nodeLifecycle        bool
	verbosity            int
}

func run(dir string, port int, o options) error {
	verbosity := o.verbosity
	bind := net.ParseIP(o.address)
	if bind == nil {
		return fmt.Errorf("--address %q is not an IP address", o.address)
	}
	// One range, or two of different families (dual-stack; the first is the primary family: the
	// `kubernetes` Service's, and every Service's that names none). The `kubernetes` Service
	// takes the first address of the primary range; the first of each goes into the serving
	// certificate.
	sans := []net.IP{net.ParseIP("127.0.0.1"), bind}
	for _, cidr := range strings.Split(o.serviceCIDR, ",") {
		_, services, err := net.ParseCIDR(strings.TrimSpace(cidr))
		if err != nil {
			return fmt.Errorf("--service-cidr: %w", err)
		}
		first := append(net.IP(nil), services.IP...)
		first[len(first)-1]++
		sans = append(sans, first)
	}
	started := time.Now()
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	_ = klogFlags.Set("v", fmt.Sprint(verbosity))
	_ = klogFlags.Set("logtostderr", "true")

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	pki, err := ensurePKI(filepath.Join(dir, "pki"), sans)
	if err != nil {
		return fmt.Errorf("certificates: %w", err)
	}
	if port == 0 {
		if port, err = freePortOn(o.address); err != nil {
			return err
		}
	}
	server := "https://" + net.JoinHostPort(o.address, fmt.Sprint(port))

	etcd, etcdURL, err := startEtcd(filepath.Join(dir, "etcd"))
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer etcd.Close()

	audit, err := writeAuditPolicy(dir)
	if err != nil {
		return err
	}
	apiserverDone := make(chan error, 1)
	go func() { apiserverDone <- runAPIServer(ctx, apiserverArgs(pki, port, etcdURL, audit, o)) }()
	if err := waitReady(ctx, server, pki, apiserverDone); err != nil {
		return fmt.Errorf("kube-apiserver: %w", err)
	}

	kubeconfig := filepath.Join(dir, "admin.kubeconfig")
	if err := writeKubeconfig(kubeconfig, server, pki); err != nil {
		return err
	}
	kcmDone := make(chan error, 1)
	go func() { kcmDone <- runControllerManager(ctx, kcmArgs(pki, kubeconfig, o)) }()

	fmt.Printf("KVSCALE_CONTROLPLANE_READY kubeconfig=%s server=%s startup_s=%.2f\n",
		kubeconfig, server, time.Since(started).Seconds())

	select {
	case <-ctx.Done():
	case err := <-apiserverDone:
		return fmt.Errorf("kube-apiserver stopped: %w", err)
	case err := <-kcmDone:
		return fmt.Errorf("kube-controller-manager stopped: %w", err)
	}
	// Shutdown: cancelling ctx stops the controllers and the API server; wait for the API
	// server to drain, then etcd closes (deferred).
	select {
	case <-apiserverDone:
	case <-time.After(30 * time.Second):
		fmt.Fprintln(os.Stderr, "kube-apiserver did not stop within 30s")
	}
	return nil
}

// auditFiles: the audit policy and log. Every request is logged at Metadata level (who, verb,
// resource, response code), so tests can check what a component actually did, e.g. that the
// operator used each verb its RBAC grants and was never refused.
type auditFiles struct{ policy, log string }

func writeAuditPolicy(dir string) (auditFiles, error) {
	a := auditFiles{policy: filepath.Join(dir, "audit-policy.yaml"), log: filepath.Join(dir, "audit.log")}
	policy := "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n"
	return a, os.WriteFile(a.policy, []byte(policy), 0o600)
}

func apiserverArgs(p pkiPaths, port int, etcdURL string, audit auditFiles, o options) []string {
	// The default endpoint reconciler refuses a loopback address; on loopback nothing needs the
	// endpoints of the `kubernetes` Service. On an address pods reach, they use it (in-cluster
	// clients, through kube-proxy).
	reconciler := "lease"
	if net.ParseIP(o.address).IsLoopback() {
		reconciler = "none"
	}
	return []string{
		"--audit-policy-file=" + audit.policy,
		"--audit-log-path=" + audit.log,
		"--audit-log-maxsize=200",
		"--bind-address=" + o.address,
		"--advertise-address=" + o.address,
		"--endpoint-reconciler-type=" + reconciler,
		// The kubelet (logs, exec, port-forward) is dialled at the node's InternalIP, not by its
		// name, which need not resolve.
		"--kubelet-preferred-address-types=InternalIP",
		fmt.Sprintf("--secure-port=%d", port),
		"--etcd-servers=" + etcdURL,
		"--tls-cert-file=" + p.serverCert,
		"--tls-private-key-file=" + p.serverKey,
		"--client-ca-file=" + p.caCert,
		// The aggregation layer (APIService objects: KEDA's external metrics adapter): the
		// request-header authentication an extension API server delegates to, and the client
		// certificate this server proxies with; routed to the Service's endpoints, not its
		// cluster IP (the adapter runs on the host, behind an EndpointSlice of the node's address).
		"--requestheader-client-ca-file=" + p.caCert,
		"--requestheader-allowed-names=front-proxy-client",
		"--requestheader-username-headers=X-Remote-User",
		"--requestheader-group-headers=X-Remote-Group",
		"--requestheader-extra-headers-prefix=X-Remote-Extra-",
		"--proxy-client-cert-file=" + p.proxyCert,
		"--proxy-client-key-file=" + p.proxyKey,
		"--enable-aggregator-routing=true",
		"--authorization-mode=Node,RBAC",
		"--service-account-key-file=" + p.saPub,
		"--service-account-signing-key-file=" + p.saKey,
		"--service-account-issuer=https://kubernetes.default.svc",
		"--api-audiences=https://kubernetes.default.svc",
		"--service-cluster-ip-range=" + o.serviceCIDR,
		// On top of the defaults: OwnerReferencesPermissionEnforcement, as OpenShift and hardened
		// clusters run it, so that the e2e tests prove the operator's RBAC lets it set
		// blockOwnerDeletion on its children (update on inferencedeployments/finalizers).
		"--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement",
		"--enable-priority-and-fairness=false",
		"--shutdown-delay-duration=0s",
		"--profiling=false",
		fmt.Sprintf("--v=%d", o.verbosity),
	}
}

func kcmArgs(p pkiPaths, kubeconfig string, o options) []string {
	enabled := controllers
	if o.nodeLifecycle {
		enabled = append(append([]string(nil), controllers...), nodeControllers...)
	}
	return []string{
		"--kubeconfig=" + kubeconfig,
		"--authentication-kubeconfig=" + kubeconfig,
		"--authorization-kubeconfig=" + kubeconfig,
		"--controllers=" + strings.Join(enabled, ","),
		"--service-account-private-key-file=" + p.saKey,
		"--root-ca-file=" + p.caCert,
		"--use-service-account-credentials=false",
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=0",
		// Fast reaction for tests: the garbage collector and the HPA sync more often.
		"--horizontal-pod-autoscaler-sync-period=5s",
		fmt.Sprintf("--v=%d", o.verbosity),
	}
}

// runAPIServer is kube-apiserver's own command without its signal handler (one process may only
// install one, and this one owns SIGTERM).
func runAPIServer(ctx context.Context, args []string) error {
	s := apiserveroptions.NewServerRunOptions()
	fs := pflag.NewFlagSet("kube-apiserver", pflag.ContinueOnError)
	for _, f := range s.Flags().FlagSets {
		fs.AddFlagSet(f)
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := s.GenericServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
		return err
	}
	completed, err := s.Complete(ctx)
	if err != nil {
		return err
	}
	if errs := completed.Validate(); len(errs) != 0 {
		return fmt.Errorf("%v", errs)
	}
	return apiserverapp.Run(ctx, completed)
}

// runControllerManager is kube-controller-manager's own command, driven by our context.
func runControllerManager(ctx context.Context, args []string) error {
	s, err := kcmoptions.NewKubeControllerManagerOptions()
	if err != nil {
		return err
	}
	known, disabled, aliases := kcmapp.KnownControllers(), kcmapp.ControllersDisabledByDefault(), kcmapp.ControllerAliases()
	named := s.Flags(known, disabled, aliases)
	s.ParsedFlags = &named
	fs := pflag.NewFlagSet("kube-controller-manager", pflag.ContinueOnError)
	for _, f := range named.FlagSets {
		fs.AddFlagSet(f)
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := s.ComponentGlobalsRegistry.Set(); err != nil {
		return err
	}
	c, err := s.Config(ctx, known, disabled, aliases)
	if err != nil {
		return err
	}
	return kcmapp.Run(ctx, c.Complete())
}

func startEtcd(dataDir string) (*embed.Etcd, string, error) {
	clientPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	peerPort, err := freePort()
	if err != nil {
		return nil, "", err
	}
	cfg := embed.NewConfig()
	cfg.Dir = dataDir
	cfg.Logger = "zap"
	cfg.LogLevel = "error"
	clientURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peerURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{clientURL}, []url.URL{clientURL}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peerURL}, []url.URL{peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, "", err
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, clientURL.String(), nil
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, "", fmt.Errorf("etcd not ready after 60s")
	}
}

// waitReady polls /readyz with the admin certificate until it answers 200.
func waitReady(ctx context.Context, server string, p pkiPaths, done <-chan error) error {
	client, err := adminHTTPClient(p)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(120 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case err := <-done:
			return fmt.Errorf("exited before ready: %w", err)
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		resp, err := client.Get(server + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("/readyz not OK after 120s")
}

func adminHTTPClient(p pkiPaths) (*http.Client, error) {
	cert, err := tls.LoadX509KeyPair(p.adminCert, p.adminKey)
	if err != nil {
		return nil, err
	}
	pool, err := loadCertPool(p.caCert)
	if err != nil {
		return nil, err
	}
	return &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool}},
	}, nil
}

func freePort() (int, error) { return freePortOn("127.0.0.1") }

func freePortOn(address string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(address, "0"))
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
