"""The text layer, shared by the router and the nodes, without torch: the tokenizer and chat
template (tokenizer.py), prompts to token ids (prompts.py), streaming detokenization and stop
strings (detok.py), and the JSON schema checks of structured output (schema.py, schema_bounds.py).
The router imports nothing else of the model runtime (tests/e2e/test_architecture.py walks it).
"""
