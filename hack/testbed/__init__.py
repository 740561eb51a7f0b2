"""The test bed: a real Kubernetes control plane on one machine, with fake GPU nodes (KWOK)
and a process node that runs pods as local processes in their own network namespaces."""
