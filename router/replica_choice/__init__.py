"""Which engine replica gets a request. Runs inside the caller of the engine handle (the ingress
replicas), in Serve's request-routing loop."""
