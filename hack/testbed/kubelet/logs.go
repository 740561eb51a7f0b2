package main

import (
	"bufio"
	"bytes"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

const followPoll = 100 * time.Millisecond

// logOptions are the kubelet's containerLogs query parameters.
type logOptions struct {
	follow     bool
	previous   bool
	timestamps bool
	tailLines  int64 // -1: all
	since      time.Time
	limitBytes int64 // -1: no limit
}

func parseLogOptions(r *http.Request) (logOptions, error) {
	q := r.URL.Query()
	opts := logOptions{
		follow:     q.Get("follow") == "true",
		previous:   q.Get("previous") == "true",
		timestamps: q.Get("timestamps") == "true",
		tailLines:  -1,
		limitBytes: -1,
	}
	for name, target := range map[string]*int64{"tailLines": &opts.tailLines, "limitBytes": &opts.limitBytes} {
		if v := q.Get(name); v != "" {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				return opts, badRequest("%s: %q is not a non-negative integer", name, v)
			}
			*target = n
		}
	}
	if v := q.Get("sinceSeconds"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n <= 0 {
			return opts, badRequest("sinceSeconds: %q is not a positive integer", v)
		}
		opts.since = time.Now().Add(-time.Duration(n) * time.Second)
	}
	if v := q.Get("sinceTime"); v != "" {
		t, err := time.Parse(time.RFC3339, v)
		if err != nil {
			return opts, badRequest("sinceTime: %v", err)
		}
		opts.since = t
	}
	return opts, nil
}

// logRecord is one line of a CRI log file: `<RFC3339Nano> <stream> <P|F> <content>`.
type logRecord struct {
	time    time.Time
	stream  string
	partial bool
	content []byte
}

func parseRecord(line []byte) (logRecord, bool) {
	fields := bytes.SplitN(bytes.TrimSuffix(line, []byte("\n")), []byte(" "), 4)
	if len(fields) < 3 {
		return logRecord{}, false
	}
	t, err := time.Parse(time.RFC3339Nano, string(fields[0]))
	if err != nil {
		return logRecord{}, false
	}
	rec := logRecord{time: t, stream: string(fields[1]), partial: string(fields[2]) == "P"}
	if len(fields) == 4 {
		rec.content = fields[3]
	}
	return rec, true
}

// render is the record as `kubectl logs` prints it.
func (rec logRecord) render(timestamps bool) []byte {
	var out []byte
	if timestamps {
		out = append(out, rec.time.Format(time.RFC3339Nano)...)
		out = append(out, ' ')
	}
	out = append(out, rec.content...)
	if !rec.partial {
		out = append(out, '\n')
	}
	return out
}

// logWriter writes records to the response, flushing each batch and stopping at limitBytes.
type logWriter struct {
	w         http.ResponseWriter
	opts      logOptions
	remaining int64
}

// write reports false once the byte limit is reached or the client is gone.
func (lw *logWriter) write(recs []logRecord) bool {
	for _, rec := range recs {
		if !lw.opts.since.IsZero() && rec.time.Before(lw.opts.since) {
			continue
		}
		out := rec.render(lw.opts.timestamps)
		if lw.remaining >= 0 && int64(len(out)) > lw.remaining {
			out = out[:lw.remaining]
		}
		if _, err := lw.w.Write(out); err != nil {
			return false
		}
		if lw.remaining >= 0 {
			lw.remaining -= int64(len(out))
			if lw.remaining == 0 {
				return false
			}
		}
	}
	if f, ok := lw.w.(http.Flusher); ok {
		f.Flush()
	}
	return true
}

// readRecords reads the complete lines available from r (a trailing unterminated line is
// left for the next read: the process node is writing it).
func readRecords(r *bufio.Reader, pending *[]byte) []logRecord {
	var recs []logRecord
	for {
		chunk, err := r.ReadBytes('\n')
		*pending = append(*pending, chunk...)
		if err != nil {
			return recs
		}
		if rec, ok := parseRecord(*pending); ok {
			recs = append(recs, rec)
		}
		*pending = nil // the record keeps the bytes
	}
}

func (s *server) containerLogs(w http.ResponseWriter, r *http.Request) {
	pod, name, c, err := s.container(r)
	if err != nil {
		writeError(w, err)
		return
	}
	opts, err := parseLogOptions(r)
	if err != nil {
		writeError(w, err)
		return
	}
	attempt := c.Log
	if opts.previous {
		if c.PreviousLog < 0 {
			writeError(w, badRequest("previous terminated container %q in pod %q not found", name, pod.Name))
			return
		}
		attempt = c.PreviousLog
	}
	path := filepath.Join(pod.dir, "logs", name, fmt.Sprintf("%d.log", attempt))
	file, err := os.Open(path)
	if err != nil {
		writeError(w, badRequest("container %q in pod %q has no log yet", name, pod.Name))
		return
	}
	defer file.Close()
	w.Header().Set("Content-Type", "text/plain")
	lw := &logWriter{w: w, opts: opts, remaining: opts.limitBytes}
	reader := bufio.NewReader(file)
	var pending []byte
	recs := readRecords(reader, &pending)
	if opts.tailLines >= 0 && int64(len(recs)) > opts.tailLines {
		recs = recs[int64(len(recs))-opts.tailLines:]
	}
	if !lw.write(recs) || !opts.follow {
		return
	}
	for {
		select {
		case <-r.Context().Done():
			return
		case <-time.After(followPoll):
		}
		// Read once more after seeing the container stop, for what it wrote last.
		stopped := !s.stillWriting(pod, name, attempt)
		if !lw.write(readRecords(reader, &pending)) || stopped {
			return
		}
	}
}

// stillWriting: the container whose log is `attempt` still runs (follow stops once it exits).
func (s *server) stillWriting(pod *podState, name string, attempt int) bool {
	now, err := s.pod(pod.Namespace, pod.Name, pod.UID)
	if err != nil {
		return false
	}
	c := now.Containers[name]
	return c.Log == attempt && c.PID != 0
}
