"""The native kernels' plumbing: build, load, dispatch without the dispatcher, argument checks."""
