"""Transfer backends: each module holds both halves of one backend (prefill sender, decode side)."""
