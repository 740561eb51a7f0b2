// The process node's kubelet API: what the API server calls on a node for `kubectl logs`,
// `exec`, `attach` and `port-forward`. The process node (hack/testbed/process_node.py) runs
// the pods; for each one it keeps <pods-dir>/<uid>/kubelet.json (which containers run, as
// which process, which log file is whose) and the containers' logs in the CRI log format
// under <pods-dir>/<uid>/logs/<container>/<run>.log, one file per run. This server reads those, enters
// the containers' namespaces with nsenter for exec, and dials inside the pod's network
// namespace for port-forward.
//
// Streams use Kubernetes' CRI streaming library (k8s.io/cri-streaming, what container
// runtimes serve the kubelet's streams with). The node does
// not declare ExtendWebSocketsToKubelet in status.declaredFeatures, so the API server
// translates websocket clients to SPDY (exec, attach) or tunnels them (port-forward) and
// speaks SPDY to this server, as it does to any kubelet that does not advertise it.
//
// TLS: the serving certificate comes from the test bed's CA; clients must present a
// certificate from that CA whose common name is --allowed-user (the API server's kubelet
// client certificate), which is all the authorization this node does.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"k8s.io/cri-streaming/pkg/streaming/portforward"
	"k8s.io/cri-streaming/pkg/streaming/remotecommand"
)

const (
	streamIdleTimeout     = 4 * time.Hour
	streamCreationTimeout = remotecommand.DefaultStreamCreationTimeout
)

// containerState is what the process node publishes about one container.
type containerState struct {
	PID int `json:"pid"` // 0 while not running
	// The numbers of the log files `kubectl logs` reads without and with --previous, as the
	// kubelet picks them (-1: none yet).
	Log         int    `json:"log"`
	PreviousLog int    `json:"previousLog"`
	Stdin       string `json:"stdin"` // FIFO feeding the container's stdin; "" without spec.stdin
}

// podState is the process node's kubelet.json for one pod.
type podState struct {
	Namespace  string                    `json:"namespace"`
	Name       string                    `json:"name"`
	UID        string                    `json:"uid"`
	Netns      string                    `json:"netns"`
	Containers map[string]containerState `json:"containers"`
	dir        string
}

type httpError struct {
	status  int
	message string
}

func (e *httpError) Error() string { return e.message }

func notFound(format string, args ...any) error {
	return &httpError{http.StatusNotFound, fmt.Sprintf(format, args...)}
}

func badRequest(format string, args ...any) error {
	return &httpError{http.StatusBadRequest, fmt.Sprintf(format, args...)}
}

func writeError(w http.ResponseWriter, err error) {
	var he *httpError
	if errors.As(err, &he) {
		http.Error(w, he.message, he.status)
		return
	}
	http.Error(w, err.Error(), http.StatusInternalServerError)
}

type server struct {
	podsDir string
}

// pod finds a pod the process node runs by namespace and name (and uid when given).
func (s *server) pod(namespace, name, uid string) (*podState, error) {
	paths, _ := filepath.Glob(filepath.Join(s.podsDir, "*", "kubelet.json"))
	for _, path := range paths {
		raw, err := os.ReadFile(path)
		if err != nil {
			continue // the pod is going away
		}
		var pod podState
		if json.Unmarshal(raw, &pod) != nil {
			continue
		}
		if pod.Namespace == namespace && pod.Name == name && (uid == "" || pod.UID == uid) {
			pod.dir = filepath.Dir(path)
			return &pod, nil
		}
	}
	return nil, notFound("pod %s/%s is not running on this node", namespace, name)
}

func (s *server) container(r *http.Request) (*podState, string, containerState, error) {
	pod, err := s.pod(r.PathValue("namespace"), r.PathValue("pod"), r.PathValue("uid"))
	if err != nil {
		return nil, "", containerState{}, err
	}
	name := r.PathValue("container")
	c, ok := pod.Containers[name]
	if !ok {
		return nil, "", containerState{}, badRequest("container %s is not valid for pod %s", name, pod.Name)
	}
	return pod, name, c, nil
}

// streamTarget is the running container an exec or attach request names, with the streams
// it asks for; it answers the request itself when there is none.
func (s *server) streamTarget(w http.ResponseWriter, r *http.Request) (*podState, string, containerState, *remotecommand.Options, bool) {
	pod, name, c, err := s.container(r)
	if err == nil && c.PID == 0 {
		err = badRequest("container %q in pod %q is not running", name, pod.Name)
	}
	var opts *remotecommand.Options
	if err == nil {
		if opts, err = remotecommand.NewOptions(r); err != nil {
			err = badRequest("%v", err)
		}
	}
	if err != nil {
		writeError(w, err)
		return nil, "", containerState{}, nil, false
	}
	return pod, name, c, opts, true
}

func (s *server) exec(w http.ResponseWriter, r *http.Request) {
	pod, name, c, opts, ok := s.streamTarget(w, r)
	if !ok {
		return
	}
	command := r.URL.Query()["command"]
	if len(command) == 0 {
		writeError(w, badRequest("no command given"))
		return
	}
	remotecommand.ServeExec(w, r, containerProcess{c.PID}, pod.Name, pod.UID, name, command, opts,
		streamIdleTimeout, streamCreationTimeout, remotecommand.SupportedStreamingProtocols)
}

func (s *server) attach(w http.ResponseWriter, r *http.Request) {
	pod, name, c, opts, ok := s.streamTarget(w, r)
	if !ok {
		return
	}
	attacher := attachedContainer{s: s, pod: pod, container: name, state: c}
	remotecommand.ServeAttach(w, r, attacher, pod.Name, pod.UID, name, opts,
		streamIdleTimeout, streamCreationTimeout, remotecommand.SupportedStreamingProtocols)
}

func (s *server) portForward(w http.ResponseWriter, r *http.Request) {
	pod, err := s.pod(r.PathValue("namespace"), r.PathValue("pod"), r.PathValue("uid"))
	if err != nil {
		writeError(w, err)
		return
	}
	opts, err := portforward.NewV4Options(r)
	if err != nil {
		writeError(w, badRequest("%v", err))
		return
	}
	portforward.ServePortForward(w, r, netnsForwarder{pod.Netns}, pod.Name, pod.UID, opts,
		streamIdleTimeout, streamCreationTimeout, portforward.SupportedProtocols)
}

// onlyUser lets in only clients whose verified certificate names `user`.
func onlyUser(user string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 {
			http.Error(w, "Unauthorized", http.StatusUnauthorized)
			return
		}
		if cn := r.TLS.VerifiedChains[0][0].Subject.CommonName; cn != user {
			http.Error(w, fmt.Sprintf("Forbidden (user=%s)", cn), http.StatusForbidden)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func main() {
	listen := flag.String("listen", "", "address:port to serve on (the node's InternalIP)")
	certFile := flag.String("tls-cert-file", "", "serving certificate")
	keyFile := flag.String("tls-private-key-file", "", "serving key")
	clientCA := flag.String("client-ca-file", "", "CA that signs client certificates")
	user := flag.String("allowed-user", "kube-apiserver-kubelet-client", "the one client let in")
	podsDir := flag.String("pods-dir", "", "the process node's per-pod directories")
	flag.Parse()
	caPEM, err := os.ReadFile(*clientCA)
	if err != nil {
		log.Fatalf("--client-ca-file: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		log.Fatalf("--client-ca-file %s holds no certificate", *clientCA)
	}
	s := &server{podsDir: *podsDir}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "ok") })
	mux.HandleFunc("GET /containerLogs/{namespace}/{pod}/{container}", s.containerLogs)
	for _, prefix := range []string{"/exec/{namespace}/{pod}", "/exec/{namespace}/{pod}/{uid}"} {
		mux.HandleFunc(prefix+"/{container}", s.exec)
	}
	for _, prefix := range []string{"/attach/{namespace}/{pod}", "/attach/{namespace}/{pod}/{uid}"} {
		mux.HandleFunc(prefix+"/{container}", s.attach)
	}
	mux.HandleFunc("/portForward/{namespace}/{pod}", s.portForward)
	mux.HandleFunc("/portForward/{namespace}/{pod}/{uid}", s.portForward)
	srv := &http.Server{
		Addr:    *listen,
		Handler: onlyUser(*user, mux),
		TLSConfig: &tls.Config{
			MinVersion: tls.VersionTLS12,
			ClientAuth: tls.RequireAndVerifyClientCert,
			ClientCAs:  pool,
		},
		// HTTP/1.1 only: SPDY and websocket upgrades need it.
		TLSNextProto:      map[string]func(*http.Server, *tls.Conn, http.Handler){},
		ReadHeaderTimeout: 30 * time.Second,
	}
	log.Printf("kubelet API on https://%s for pods under %s", *listen, *podsDir)
	log.Fatal(srv.ListenAndServeTLS(*certFile, *keyFile))
}
