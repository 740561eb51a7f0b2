# Sourced by the hack/build-* scripts that compile a Go program from the Go module proxy into
# the test bed's cache outside the repository. Sets CACHE; `go_build_env NAME` checks for Go
# and points the module and build caches into CACHE; `go_build_lock NAME` holds a lock of its
# own for the rest of the script, so that tests racing for the same build wait for one.
CACHE="${DYNAMO_TESTBED_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamo-testbed}"

go_build_env() {
  command -v go >/dev/null || { printf 'Go is needed to build %s (none on PATH)\n' "$1" >&2; exit 1; }
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
  export GOMODCACHE="$CACHE/gomod" GOCACHE="$CACHE/gobuild"
}

go_build_lock() {
  mkdir -p "$CACHE"
  exec 9>"$CACHE/$1.lock"
  flock 9
}
