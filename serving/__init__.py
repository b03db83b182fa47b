"""A node's serving infrastructure: its gRPC server (Admin, health, reflection), the front between
the services and the rank processes, the wire adapters, and the colocated node."""
