"""Code run by the engine replica actors (the `EngineReplica` deployment): the AsyncEngine, the
outbox behind each ingress's output channel, and the stats Serve polls."""
