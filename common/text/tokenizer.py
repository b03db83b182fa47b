"""Tokenizer and chat template, both read from the model's own files.

Sources: a GGUF file's `tokenizer.ggml.*` fields (byte-level BPE), a Hugging Face
directory's tokenizer.json + tokenizer_config.json, or a byte-level vocabulary built
for the tiny-random preset.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizer splits by GGUF `tokenizer.ggml.pre`, as the vocabularies were trained.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama3", "llama-v3", "llama-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool = False,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos = add_bos and bos_token is not None
        self._template = None
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's ids, after BOS when the model adds one (and the text does not start with it);
        add_special_tokens=False: never a BOS added. The library's batch call lets go of the GIL while
        it works; its single call holds it throughout (~1 s a MB), stalling every other thread of the
        process (an event loop's)."""
        batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # (_fast: 0.20 on)
        ids = batch([text], add_special_tokens=False)[0].ids
        bos = self.token_id(self.bos_token) if self.add_bos and add_special_tokens else None
        return ([bos] if bos is not None and ids[:1] != [bos] else []) + ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
    ) -> str:
        """The chat as the model's template renders it, as transformers' apply_chat_template does.
        continue_final_message: the text ends right after the last message's content (its end of
        turn cut off), so the output continues that message; add_generation_prompt must be False.
        template_kwargs: more variables for the template (never over TEMPLATE_VARIABLES).
        ValueError for a chat the template refuses or cannot render."""
        if self._template is None:
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt False")
        if continue_final_message and not messages:
            raise ValueError("continue_final_message needs a final message to continue")
        if taken := sorted(set(template_kwargs or ()) & set(TEMPLATE_VARIABLES)):
            raise ValueError(f"template variable {taken[0]!r} is the tokenizer's own; it cannot be set")
        if continue_final_message:  # tag the content's end, then cut there (transformers' way)
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        own = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        own |= {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        try:
            text = self._template.render({**(template_kwargs or {}), **own})
        except ValueError:
            raise
        except Exception as e:  # the template's own error on this chat (jinja2's, or a TypeError...)
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from None
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise ValueError("continue_final_message: the chat template does not render the final message's content")
        # a template that strips the content strips the tag's space too: then strip what precedes it
        return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()

    def to_json(self) -> str:
        return json.dumps(
            {
                "backend": self.backend.to_str(),
                "chat_template": self.chat_template,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "add_bos": self.add_bos,
            }
        )

    @staticmethod
    def from_json(text: str) -> Tokenizer:
        d = json.loads(text)
        return Tokenizer(
            HFTokenizer.from_str(d["backend"]), d["chat_template"], d["bos_token"], d["eos_token"], d["add_bos"]
        )

    @staticmethod
    def from_gguf_fields(fields: dict) -> Tokenizer:
        """fields: GGUF metadata {key: value} holding the `tokenizer.ggml.*` keys."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (byte-level BPE 'gpt2' only)")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        # control (3) and user-defined (4) tokens are matched whole, never split
        backend.add_special_tokens(
            [AddedToken(t, special=(ty == 3), normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
        )
        bos, eos = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
        return Tokenizer(
            backend,
            fields.get("tokenizer.chat_template"),
            tokens[bos] if bos is not None else None,
            tokens[eos] if eos is not None else None,
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        )

    @staticmethod
    def from_hf_dir(path: Path) -> Tokenizer | None:
        """None when the directory has no tokenizer.json (the model then takes token ids only)."""
        if not (path / "tokenizer.json").exists():
            return None
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        return Tokenizer(
            backend,
            template,
            _token_text(cfg.get("bos_token")),
            _token_text(cfg.get("eos_token")),
            add_bos=bool(cfg.get("add_bos_token", False)),
        )

    @staticmethod
    def byte_level(vocab_size: int) -> Tokenizer:
        """256 byte tokens plus ChatML specials, no merges: for the tiny-random preset."""
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tokens = specials + sorted(alphabet)
        if vocab_size < len(tokens):
            raise ValueError(f"byte-level vocabulary needs {len(tokens)} ids, vocab_size is {vocab_size}")
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return Tokenizer(backend, CHATML_TEMPLATE, None, "<|im_end|>")


# The variables the tokenizer itself hands the template: template_kwargs cannot set them.
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the final message's end

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise_template_error(message: str):
    raise ValueError(f"chat template: {message}")
