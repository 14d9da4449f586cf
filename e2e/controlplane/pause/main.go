// pause: the sandbox ("infra") container of every pod on the test node. It holds the pod's
// namespaces, reaps children that get reparented to it, and exits on SIGTERM or SIGINT.
// Built static (CGO_ENABLED=0) and imported into containerd as a local image, never pulled.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
