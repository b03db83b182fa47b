"""kvbridge: disaggregated prefill/decode LLM serving.

The one installed top-level package. It imports nothing: every layer may import it (for the
version), and each layer is a subpackage (see docs/architecture.md, Layers)."""

__version__ = "0.1.0"
