"""common/text/detok.py: streaming detokenization with bounded work per token, stop strings found on the
new text only (also across token boundaries), and the scheduler's stop strings unchanged by it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.common.sampling import MAX_STOP_CHARS, MAX_STOP_STRING_CHARS, SamplingParams
from kvbridge.common.text.detok import (
    MAX_WORK_PER_TOKEN,
    IncrementalDetokenizer,
    StopChecker,
    StopMatcher,
    TextStream,
    special_ids,
    stop_text_ids,
)
from tests.conftest import make_llm, make_prompts

TEXT = "Hello, wörld! Ça va? 世界你好 😀🎉 naïve café — “quotes” ½ ∑ ok.\n"


def byte_ids(tok, text: str) -> list[int]:
    """tiny-random's tokenizer has no merges: one token per UTF-8 byte."""
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())
    return ids


def mixed_stream(tok, n: int, seed: int) -> list[int]:
    """n ids: runs of real text (multi-byte characters split anywhere), random ids, special tokens,
    and runs of bytes that never form a character (only tiny-random has single-byte tokens)."""
    rng = random.Random(seed)
    text_ids = tok.encode(TEXT * 4)
    specials = sorted(special_ids(tok))
    invalid = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"] if tok.vocab_size < 1000 else []
    ids: list[int] = []
    while len(ids) < n:
        k = rng.random()
        if k < 0.5:
            start = rng.randrange(len(text_ids))
            ids += text_ids[start : start + rng.randint(1, 40)]
        elif k < 0.8:
            ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 10))]
        elif k < 0.9 or not invalid:
            ids.append(rng.choice(specials))
        else:
            ids += [rng.choice(invalid) for _ in range(rng.randint(1, 30))]
    return ids[:n]


def push_all(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], list[int]]:
    """(pieces, ids passed to decode by each push)."""
    pieces, work = [], []
    for t in ids:
        before = detok.tokens_decoded
        pieces.append(detok.push(t))
        work.append(detok.tokens_decoded - before)
    return pieces, work


@pytest.fixture(scope="module", params=["tiny-random", "smollm2-135m-instruct"])
def tokenizer(request, tiny_model, default_model):
    return (tiny_model if request.param == "tiny-random" else default_model).tokenizer


def test_4000_token_stream_costs_constant_work_per_token_and_decodes_exactly(tokenizer):
    ids = mixed_stream(tokenizer, 4000, seed=0)
    detok = IncrementalDetokenizer(tokenizer)
    pieces, work = push_all(detok, ids)
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)
    assert max(work) <= MAX_WORK_PER_TOKEN  # whatever the position: the first token and the 4000th
    assert sum(work) <= 8 * len(ids)  # in practice a few ids per token (re-decoding everything: 8 million)


@pytest.mark.parametrize("seed", range(40))
def test_random_ids_decode_exactly(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    detok = IncrementalDetokenizer(tokenizer)
    pieces, work = push_all(detok, ids)
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids)
    assert max(work) <= MAX_WORK_PER_TOKEN


@pytest.mark.parametrize("seed", range(4))
def test_special_tokens_shown_decode_exactly(tokenizer, seed):
    ids = mixed_stream(tokenizer, 600, seed=100 + seed)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    pieces, work = push_all(detok, ids)
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=False)
    assert max(work) <= MAX_WORK_PER_TOKEN


def test_multibyte_characters_appear_when_their_last_byte_does(tiny_model):
    tok = tiny_model.tokenizer
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(t) for t in byte_ids(tok, "aé世😀b")]
    # bytes: a | C3 A9 | E4 B8 96 | F0 9F 98 80 | b
    assert pieces == ["a", "", "é", "", "", "世", "", "", "", "😀", "b"]


def test_bytes_that_never_form_a_character_are_cut_by_force_and_still_decode_exactly(tiny_model):
    tok = tiny_model.tokenizer
    lead = byte_ids(tok, "😀")[0]  # F0: a four-byte lead, repeated: never a character
    ids = [lead] * 50 + byte_ids(tok, "x😀")
    detok = IncrementalDetokenizer(tok)
    pieces, work = push_all(detok, ids)
    assert "".join(pieces) == tok.decode(ids) == "\ufffd" * 50 + "x😀"
    assert max(work) <= MAX_WORK_PER_TOKEN
    assert sum(1 for p in pieces[:50] if p) >= 4  # shown while the run goes on, not held to its end


def test_special_tokens_are_skipped_without_widening_the_window(tiny_model):
    tok = tiny_model.tokenizer
    detok = IncrementalDetokenizer(tok)
    eos = tok.token_id("<|im_end|>")
    pieces, work = push_all(detok, [*byte_ids(tok, "ab"), *[eos] * 100, *byte_ids(tok, "c")])
    assert "".join(pieces) == "abc" and work[2:102] == [0] * 100


# ---------------------------------------------------------------- stop strings


def test_stop_matcher_finds_stop_strings_ending_in_the_new_text():
    m = StopMatcher(("STOP", "xy"))
    assert m.push("aaST") is None and m.num_held() == 2  # "ST" may become "STOP"
    assert m.push("O") is None and m.num_held() == 3
    assert m.push("Pzz") == 2  # STOP starts at offset 2 of "aaSTOPzz"
    m = StopMatcher(("xy",))
    assert m.push("axy", match=False) is None  # before min_tokens: remembered, not matched
    assert m.push("b") is None  # "xy" ended before this piece: never found again
    assert m.push("x") is None and m.num_held() == 1
    assert m.push("y") == 4  # the second "xy" of "axybxy"


def naive_cut(before: str, new: str, stops: tuple[str, ...], include: bool) -> int | None:
    """A full search of before + new: where the earliest starting stop string that ends inside `new`
    starts (with `include`: where the earliest ending one ends)."""
    text, cuts = before + new, []
    for s in stops:
        for i in range(max(0, len(before) - len(s) + 1), len(text) - len(s) + 1):
            if text.startswith(s, i):
                cuts.append(i + len(s) if include else i)
    return min(cuts, default=None)


def naive_held(text: str, stops: tuple[str, ...]) -> int:
    """The longest end of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


SMALL_ALPHABET = st.sampled_from("abé😀")  # few letters: matches and near-matches are common


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    stops=st.lists(st.text(SMALL_ALPHABET, min_size=1, max_size=6), min_size=1, max_size=5),
    pieces=st.lists(st.tuples(st.text(SMALL_ALPHABET, max_size=5), st.booleans()), max_size=25),
    include=st.booleans(),
)
def test_stop_matcher_equals_a_full_search_after_every_piece(stops, pieces, include):
    m = StopMatcher(tuple(stops), include)
    text = ""
    for new, match in pieces:
        assert m.push(new, match) == (naive_cut(text, new, tuple(stops), include) if match else None)
        text += new
        assert m.num_held() == (0 if include else naive_held(text, tuple(stops)))
        assert m.num_chars == len(text)


@pytest.mark.parametrize("include", [False, True])
def test_stop_matcher_work_per_character_is_bounded_whatever_the_stop_strings(include):
    """4 stop strings of 1024 characters (the limits: one string's, and all strings' together) that
    the text keeps almost matching: each character still costs at most 2 moves on the whole (the
    old window search cost ~190 ms a token with 32,000-character stop strings)."""
    stops = tuple("ab" * 511 + f"{i:02d}" for i in range(4))
    assert len(stops[0]) == MAX_STOP_STRING_CHARS and sum(map(len, stops)) == MAX_STOP_CHARS
    m = StopMatcher(stops, include)
    text = ("ab" * 700 + "x") * 6 + "ab" * 511 + "03"
    cuts = [m.push(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert m.moves <= 2 * len(text)
    hits = [c for c in cuts if c is not None]
    assert hits == [len(text) if include else len(text) - 1024]


def test_the_earliest_starting_stop_string_wins_as_in_a_full_search():
    m = StopMatcher(("cd", "bcdef", "d"))
    assert m.push("abc") is None
    assert m.push("def") == 1  # all three end in "def"; "bcdef" starts first, as str.index over "abcdef" says


def test_stop_string_split_across_tokens_is_held_back_then_cut(tiny_model):
    tok = tiny_model.tokenizer
    stream = TextStream(tok, ("STOP",))
    sent = [stream.push(t) for t in byte_ids(tok, "go STAR STOP after")]
    # "ST" of "STAR" is held until "A" shows it is not "STOP"; "STOP" and all after it never go out
    assert sent == ["g", "o", " ", "", "", "STA", "R", " ", "", "", "", "", "", "", "", "", "", ""]
    assert "".join(sent) == "go STAR "
    assert stream.finish("go STAR ") == ""


def test_multibyte_stop_string_across_tokens(tiny_model):
    tok = tiny_model.tokenizer
    checker = StopChecker(tok, ("é!",))
    for t in byte_ids(tok, "café! more"):
        checker.push(t)
        if checker.cut is not None:
            break
    assert checker.text() == "caf" and checker.detok.num_tokens == 6  # c a f C3 A9 !


def test_text_stream_holds_nothing_back_without_stop_strings_and_finishes_with_the_rest(tiny_model):
    tok = tiny_model.tokenizer
    ids = mixed_stream(tok, 600, seed=3)
    stream = TextStream(tok)
    sent = "".join(stream.push(t) for t in ids)
    final = tok.decode(ids)
    assert final.startswith(sent) and len(final) - len(sent) <= 1  # at most an unfinished character
    assert sent + stream.finish(final) == final


def test_text_stream_ignores_stop_strings_before_min_tokens(tiny_model):
    tok = tiny_model.tokenizer
    stream = TextStream(tok, ("b",), min_tokens=3)
    assert [stream.push(t) for t in byte_ids(tok, "abcbd")] == ["a", "b", "c", "", ""]
    assert stream.finish("abc") == ""


def test_no_tokenizer_streams_no_text():
    stream = TextStream(None, ("x",))
    assert stream.push(5) == "" and stream.finish("") == ""


# ---------------------------------------------------------------- the scheduler, as before


def reference_stop(tok, free_run: list[int], stops: tuple[str, ...], include=False) -> tuple[list[int], str, str]:
    """The rule before common/text/detok.py: after each token decode the whole output; the first time any
    stop string is in it, the output ends there and the text is cut at the earliest one (include:
    right after the earliest ending one)."""
    for n in range(1, len(free_run) + 1):
        text = tok.decode(free_run[:n])
        hits = [text.index(s) + (len(s) if include else 0) for s in stops if s in text]
        if hits:
            return free_run[:n], text[: min(hits)], "stop"
    return free_run, tok.decode(free_run), "length"


@pytest.mark.parametrize("include", [False, True])
def test_scheduler_stop_strings_give_the_same_text_and_finish_as_a_full_decode(tiny_model, include):
    llm = make_llm(tiny_model)
    prompts = make_prompts(8, tiny_model.config.vocab_size, seed=7)
    free_runs = [c.output_ids for c in llm.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))]
    rng = random.Random(1)
    cases = []
    for prompt, run in zip(prompts, free_runs):
        text = llm.tokenizer.decode(run)
        # (no U+FFFD in them: a full decode shows an unfinished character as one, for a token or two)
        starts = [i for i in range(1, len(text) - 3) if "\ufffd" not in text[i : i + 3]]
        for _ in range(5):  # one or two stop strings taken from the output, 1 to 3 characters each
            i, j = rng.choice(starts), rng.choice(starts)
            cases.append((prompt, run, (text[i : i + rng.randint(1, 3)], text[j : j + 2])[: rng.randint(1, 2)]))
        cases.append((prompt, run, ("not in the output at all",)))
    params = [
        SamplingParams(max_new_tokens=40, stop=stops, ignore_eos=True, include_stop_str_in_output=include)
        for _, _, stops in cases
    ]
    got = llm.generate([p for p, _, _ in cases], params)
    for (_, run, stops), c, p in zip(cases, got, params):
        assert (c.output_ids, c.text, c.finish_reason) == reference_stop(llm.tokenizer, run, stops, include), stops
        # the front's stream of the same tokens never sends what the engine cut off, and ends with its text
        stream = TextStream.for_params(llm.tokenizer, p, tiny_model.config.eos_token_ids)
        sent = "".join(stream.push(t) for t in c.output_ids)
        assert c.text.startswith(sent) and sent + stream.finish(c.text) == c.text
    assert {c.finish_reason for c in got} == {"stop", "length"}


def test_stop_string_at_the_very_start_leaves_empty_text(tiny_model):
    llm = make_llm(tiny_model)
    prompts = make_prompts(20, tiny_model.config.vocab_size, seed=8)
    runs = llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    prompt, run = next(
        (p, c.output_ids) for p, c in zip(prompts, runs) if llm.tokenizer.decode(c.output_ids[:1]).isalnum()
    )
    first = llm.tokenizer.decode(run[:1])
    [c] = llm.generate([prompt], SamplingParams(max_new_tokens=8, stop=(first,), ignore_eos=True))
    assert (c.output_ids, c.text, c.finish_reason) == (run[:1], "", "stop")


def test_scheduler_keeps_no_detokenizer_without_stop_strings(tiny_model):
    llm = make_llm(tiny_model)
    req = llm.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    llm.step()
    llm.step()
    assert req.output_ids and req.stop_checker is None


# ---------------------------------------------------------------- skip_special_tokens, include_stop_str_in_output


def pushed(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.push(t) for t in ids]


def checked(tok, ids: list[int], stops: tuple[str, ...], **options) -> tuple[str, int]:
    """(rank 0's text, tokens taken until a stop string ended it)."""
    checker = StopChecker(tok, stops, **options)
    for n, t in enumerate(ids, 1):
        checker.push(t)
        if checker.cut is not None:
            return checker.text(), n
    return checker.text(), len(ids)


def test_stop_string_across_tokens_is_excluded_or_included_up_to_its_end(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("Hello world, this is done")  # Hello | " world" | "," | " this" | " is" | " done"
    assert len(ids) == 6
    # "ld, th" spans three tokens and ends inside " this": its "is" is cut either way
    assert checked(tok, ids, ("ld, th",)) == ("Hello wor", 4)
    assert checked(tok, ids, ("ld, th",), include_stop_str=True) == ("Hello world, th", 4)
    excluded = TextStream(tok, ("ld, th",))
    assert pushed(excluded, ids) == ["Hello", " wor", "", "", "", ""]  # "ld", "ld," held back, then cut
    assert excluded.finish("Hello wor") == ""
    included = TextStream(tok, ("ld, th",), include_stop_str=True)
    assert pushed(included, ids) == ["Hello", " world", ",", " th", "", ""]  # nothing held back
    assert included.finish("Hello world, th") == ""


def test_included_stop_string_split_across_byte_tokens_streams_every_byte_at_once(tiny_model):
    tok = tiny_model.tokenizer
    ids = byte_ids(tok, "go STAR STOP after")
    stream = TextStream(tok, ("STOP",), include_stop_str=True)
    sent = pushed(stream, ids)
    assert sent == list("go STAR STOP") + [""] * 6
    assert checked(tok, ids, ("STOP",), include_stop_str=True) == ("go STAR STOP", 12)
    assert stream.finish("go STAR STOP") == ""
    assert StopMatcher(("STOP",), include=True).num_held() == 0


def test_the_earliest_ending_stop_string_wins_when_included():
    m = StopMatcher(("cd", "bcdef", "d"), include=True)
    assert m.push("abc") is None
    assert m.push("def") == 4  # "cd" and "d" end at 4, "bcdef" at 6: the text is "abcd"


def test_special_tokens_show_mid_output_unless_skipped(default_model):
    tok = default_model.tokenizer
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    ids = [*tok.encode("Hello"), im_start, *tok.encode(" world"), im_end, *tok.encode(" more")]
    assert pushed(TextStream(tok), ids) == ["Hello", "", " world", "", " more"]
    shown = pushed(TextStream(tok, skip_special_tokens=False), ids)
    assert shown == ["Hello", "<|im_start|>", " world", "<|im_end|>", " more"]
    assert "".join(shown) == tok.decode(ids, skip_special_tokens=False) == "Hello<|im_start|> world<|im_end|> more"
    # stop strings are matched on the text as produced: "> w" is only there with the special tokens shown
    assert checked(tok, ids, ("> w",)) == ("Hello world more", 5)
    assert checked(tok, ids, ("> w",), skip_special_tokens=False) == ("Hello<|im_start|", 3)


def test_the_ending_eos_leaves_no_text_unless_stop_strings_are_included(default_model):
    tok = default_model.tokenizer
    eos = default_model.config.eos_token_ids
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert eos == (im_end,)
    ids = [*tok.encode("Hello"), im_start, *tok.encode(" world"), im_end]  # EOS ends the request
    cases = [
        (SamplingParams(), ["Hello", "", " world", ""], "Hello world"),
        (SamplingParams(skip_special_tokens=False), ["Hello", "<|im_start|>", " world", ""], "Hello<|im_start|> world"),
        (
            SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True),
            ["Hello", "<|im_start|>", " world", "<|im_end|>"],
            "Hello<|im_start|> world<|im_end|>",
        ),
    ]
    for params, deltas, final in cases:
        stream = TextStream.for_params(tok, params, eos)
        assert pushed(stream, ids) == deltas
        assert stream.finish(final) == "" and "".join(deltas) == final
    # the held back EOS goes out once the next token shows it did not end the request (ignore_eos is
    # not set, but a stream cannot know: the scheduler ends the request on it)
    stream = TextStream.for_params(tok, SamplingParams(skip_special_tokens=False), eos)
    assert pushed(stream, [im_end, *tok.encode("Hi")]) == ["", "<|im_end|>Hi"]
    assert stop_text_ids(tok, SamplingParams(skip_special_tokens=False, ignore_eos=True), eos) == frozenset()
    assert stop_text_ids(tok, SamplingParams(), eos) == frozenset()  # skipped: no text to hold back


def eos_run(llm, eos: int) -> tuple[list[int], list[int], int]:
    """(prompt, greedy output with ignore_eos, index of its first EOS), the EOS after some text."""
    prompts = make_prompts(64, llm.model.config.vocab_size, seed=0, min_len=3, max_len=40)
    runs = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for prompt, c in zip(prompts, runs):
        if eos in c.output_ids[3:16]:
            return prompt, c.output_ids, c.output_ids.index(eos)
    raise AssertionError("no greedy output reaches EOS")


def test_engine_text_under_both_options_matches_the_stream(tiny_model):
    llm = make_llm(tiny_model)
    tok = llm.tokenizer
    [eos] = tiny_model.config.eos_token_ids
    prompt, run, j = eos_run(llm, eos)
    shown, hidden = tok.decode(run, skip_special_tokens=False), tok.decode(run)
    assert "<|im_end|>" in shown and "<|im_end|>" not in hidden
    head = tok.decode(run[:j], skip_special_tokens=False)  # the text before the EOS
    stop_tok = run[1]  # (not EOS: a byte, whose text is not skipped)
    assert stop_tok != eos and tok.decode([stop_tok])
    cases = [  # params, (tokens, text) expected
        (SamplingParams(max_new_tokens=24, ignore_eos=True), (run, hidden)),
        (SamplingParams(max_new_tokens=24, ignore_eos=True, skip_special_tokens=False), (run, shown)),
        (SamplingParams(max_new_tokens=24, skip_special_tokens=False), (run[: j + 1], head)),
        (
            SamplingParams(max_new_tokens=24, skip_special_tokens=False, include_stop_str_in_output=True),
            (run[: j + 1], head + "<|im_end|>"),
        ),
        # a stop token that is no special token: its text is left out too, unless included (vLLM)
        (SamplingParams(max_new_tokens=24, stop_token_ids=(stop_tok,)), (run[:2], tok.decode(run[:1]))),
        (
            SamplingParams(max_new_tokens=24, stop_token_ids=(stop_tok,), include_stop_str_in_output=True),
            (run[:2], tok.decode(run[:2])),
        ),
    ]
    got = llm.generate([prompt] * len(cases), [p for p, _ in cases])
    for (params, want), c in zip(cases, got):
        assert (c.output_ids, c.text, c.finish_reason) == (*want, "stop" if len(want[0]) < 24 else "length"), params
        stream = TextStream.for_params(tok, params, tiny_model.config.eos_token_ids)
        sent = "".join(pushed(stream, c.output_ids))
        assert c.text.startswith(sent) and sent + stream.finish(c.text) == c.text, params
