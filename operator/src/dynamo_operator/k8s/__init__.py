"""The thin Kubernetes client layer: server-side apply, reads, status patches."""
