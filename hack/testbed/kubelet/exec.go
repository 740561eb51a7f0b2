package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/creack/pty"
	"k8s.io/cri-streaming/pkg/streaming/remotecommand"
	utilexec "k8s.io/utils/exec"
)

// containerProcess runs commands beside a container's main process: in its mount and
// network namespaces, its working directory and its environment (what `kubectl exec` gets
// in a container).
type containerProcess struct {
	pid int
}

func (p containerProcess) command(ctx context.Context, argv []string) (*exec.Cmd, error) {
	environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", p.pid))
	if err != nil {
		return nil, fmt.Errorf("container process %d: %w", p.pid, err)
	}
	target := strconv.Itoa(p.pid)
	args := append([]string{"--target", target, "--mount", "--net", "--wd", "--"}, argv...)
	cmd := exec.CommandContext(ctx, "nsenter", args...)
	cmd.Env = nil
	for _, kv := range bytes.Split(environ, []byte{0}) {
		if len(kv) > 0 {
			cmd.Env = append(cmd.Env, string(kv))
		}
	}
	return cmd, nil
}

func (p containerProcess) ExecInContainer(ctx context.Context, _, _, _ string, argv []string, in io.Reader, out, errOut io.WriteCloser, tty bool, resize <-chan remotecommand.TerminalSize, _ time.Duration) error {
	cmd, err := p.command(ctx, argv)
	if err != nil {
		return err
	}
	if tty {
		err = runWithTTY(cmd, in, out, resize)
	} else {
		err = runWithPipes(cmd, in, out, errOut)
	}
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		code := exitErr.ExitCode()
		if status, ok := exitErr.Sys().(syscall.WaitStatus); ok && status.Signaled() {
			code = 128 + int(status.Signal())
		}
		return utilexec.CodeExitError{Err: err, Code: code}
	}
	return err
}

func runWithPipes(cmd *exec.Cmd, in io.Reader, out, errOut io.Writer) error {
	cmd.Stdout, cmd.Stderr = out, errOut
	if in == nil {
		return cmd.Run()
	}
	// Stdin by hand: exec.Cmd would wait for the client's stdin to end even after the
	// command exited.
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	go func() {
		_, _ = io.Copy(stdin, in)
		stdin.Close()
	}()
	return cmd.Wait()
}

func runWithTTY(cmd *exec.Cmd, in io.Reader, out io.Writer, resize <-chan remotecommand.TerminalSize) error {
	terminal, err := pty.Start(cmd)
	if err != nil {
		return err
	}
	defer terminal.Close()
	go func() {
		for size := range resize {
			_ = pty.Setsize(terminal, &pty.Winsize{Rows: size.Height, Cols: size.Width})
		}
	}()
	if in != nil {
		go func() { _, _ = io.Copy(terminal, in) }()
	}
	copied := make(chan struct{})
	go func() {
		// Ends with EIO once the command and its children closed the terminal.
		_, _ = io.Copy(out, terminal)
		close(copied)
	}()
	err = cmd.Wait()
	select {
	case <-copied:
	case <-time.After(2 * time.Second): // a background child still holds the terminal
	}
	return err
}

// attachedContainer streams a running container's output (as it reaches its log) and, when
// the container has spec.stdin, feeds its stdin FIFO.
type attachedContainer struct {
	s         *server
	pod       *podState
	container string
	state     containerState
}

func (a attachedContainer) AttachContainer(ctx context.Context, _, _, _ string, in io.Reader, out, errOut io.WriteCloser, tty bool, _ <-chan remotecommand.TerminalSize) error {
	if in != nil && a.state.Stdin != "" {
		fifo, err := os.OpenFile(a.state.Stdin, os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		defer fifo.Close()
		go func() { _, _ = io.Copy(fifo, in) }()
	}
	path := filepath.Join(a.pod.dir, "logs", a.container, fmt.Sprintf("%d.log", a.state.Log))
	file, err := os.Open(path)
	if err != nil {
		return err
	}
	defer file.Close()
	if _, err := file.Seek(0, io.SeekEnd); err != nil {
		return err
	}
	reader := bufio.NewReader(file)
	var pending []byte
	for {
		for _, rec := range readRecords(reader, &pending) {
			target := out
			if rec.stream == "stderr" && !tty && errOut != nil {
				target = errOut
			}
			if target != nil {
				if _, err := target.Write(rec.render(false)); err != nil {
					return nil // the client went away
				}
			}
		}
		if !a.s.stillWriting(a.pod, a.container, a.state.Log) {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(followPoll):
		}
	}
}
