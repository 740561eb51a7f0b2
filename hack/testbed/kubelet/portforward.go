package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// netnsForwarder connects port-forward streams to 127.0.0.1:<port> inside the pod's network
// namespace, as a container runtime does (so a server bound to the pod's loopback is
// reachable too, and NetworkPolicy, which guards the pod's veth, does not apply).
type netnsForwarder struct {
	netns string
}

func (f netnsForwarder) PortForward(ctx context.Context, _, _ string, port int32, stream io.ReadWriteCloser) error {
	defer stream.Close()
	conn, err := dialInNetns(ctx, f.netns, port)
	if err != nil {
		return fmt.Errorf("pod netns %s, port %d: %w", f.netns, port, err)
	}
	defer conn.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(conn, stream); done <- struct{}{} }()
	go func() { _, _ = io.Copy(stream, conn); done <- struct{}{} }()
	<-done
	return nil
}

// dialInNetns creates the socket on a thread switched into the pod's network namespace
// (a socket stays in the namespace it was created in), then switches the thread back.
func dialInNetns(ctx context.Context, netns string, port int32) (net.Conn, error) {
	runtime.LockOSThread()
	own, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer own.Close()
	target, err := os.Open("/run/netns/" + netns)
	if err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	dialer := net.Dialer{Timeout: 5 * time.Second}
	conn, dialErr := dialer.DialContext(ctx, "tcp4", fmt.Sprintf("127.0.0.1:%d", port))
	if err := unix.Setns(int(own.Fd()), unix.CLONE_NEWNET); err != nil {
		// Leave the thread locked: Go retires it when this goroutine ends, so no other
		// goroutine ever runs in the pod's namespace.
		if conn != nil {
			conn.Close()
		}
		return nil, fmt.Errorf("switching back from %s: %w", netns, err)
	}
	runtime.UnlockOSThread()
	return conn, dialErr
}
