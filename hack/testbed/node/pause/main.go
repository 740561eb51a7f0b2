// The kubelet node's pod sandbox program (what registry.k8s.io/pause is elsewhere, which
// cannot be pulled here): it holds the pod's namespaces until it is told to stop, and reaps
// nothing else, as PID 1 of a sandbox has nothing else to reap.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
