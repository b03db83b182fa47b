"""What every layer shares (gRPC factory, TLS and keys, logs, metrics plumbing, input bounds, progress
lines). It imports nothing of the project but the generated stubs (kvbridge.v1)."""
