"""engine/detok.py: streaming detokenization with bounded work per token, stop strings found on the
new text only (also across token boundaries), and the scheduler's stop strings unchanged by it."""

from __future__ import annotations

import random

import pytest

from common.sampling import SamplingParams
from engine.detok import MAX_WORK_PER_TOKEN, IncrementalDetokenizer, StopChecker, StopMatcher, TextStream, special_ids
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


def test_stop_matcher_searches_only_the_new_tail():
    m = StopMatcher(("STOP", "xy"))
    assert m.push("aaST") is None and m.num_held() == 2  # "ST" may become "STOP"
    assert m.push("O") is None and m.num_held() == 3
    assert m.push("Pzz") == 2  # STOP starts at offset 2 of "aaSTOPzz"
    m = StopMatcher(("xy",))
    assert m.push("axy", match=False) is None  # before min_tokens: remembered, not matched
    assert m.push("b") is None  # "xy" ended before this piece: never found again
    assert m.push("x") is None and m.num_held() == 1
    assert m.push("y") == 4  # the second "xy" of "axybxy"
    assert len(m._tail) <= 1  # only max_len - 1 characters are kept


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


def reference_stop(tok, free_run: list[int], stops: tuple[str, ...]) -> tuple[list[int], str, str]:
    """The rule before engine/detok.py: after each token decode the whole output; the first time any
    stop string is in it, the output ends there and the text is cut at the earliest one."""
    for n in range(1, len(free_run) + 1):
        text = tok.decode(free_run[:n])
        hits = [text.index(s) for s in stops if s in text]
        if hits:
            return free_run[:n], text[: min(hits)], "stop"
    return free_run, tok.decode(free_run), "length"


def test_scheduler_stop_strings_give_the_same_text_and_finish_as_a_full_decode(tiny_model):
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
    params = [SamplingParams(max_new_tokens=40, stop=stops, ignore_eos=True) for _, _, stops in cases]
    got = llm.generate([p for p, _, _ in cases], params)
    for (_, run, stops), c in zip(cases, got):
        assert (c.output_ids, c.text, c.finish_reason) == reference_stop(llm.tokenizer, run, stops), stops
        # the front's stream of the same tokens never sends what the engine cut off, and ends with its text
        stream = TextStream(llm.tokenizer, stops)
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
