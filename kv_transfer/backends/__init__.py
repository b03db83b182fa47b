"""Transfer engines: each module holds both halves of one engine (prefill sender, decode side)."""
