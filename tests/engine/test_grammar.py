"""Structured output (engine/grammar.py): seeded random-logit runs constrained by a schema always end
in EOS with JSON valid under it, on the default model's vocabulary and on the tiny byte-level one; a
replayed matcher masks as the original; whitespace cannot run forever; schema checks; the cache."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

import kvbridge.common.text.schema
from kvbridge.common.sampling import MAX_SCHEMA_CHARS, SamplingParams
from kvbridge.common.text.schema import MAX_WHITESPACE, schema_problem
from kvbridge.common.text.schema_bounds import MAX_SCHEMA_COMBINATIONS, MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES
from kvbridge.common.text.tokenizer import Tokenizer
from kvbridge.engine.grammar import GrammarCompiler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "vip": {"type": "boolean"},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "vip", "address"],
            "additionalProperties": False,
        },
        "total": {"type": "number"},
    },
    "required": ["id", "customer", "total"],
    "additionalProperties": False,
}
NO_STRINGS = {  # nothing but numbers, booleans, one enum and structure: whitespace is the only free text
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
        "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
        "c": {"enum": ["a", "b"]},
    },
    "required": ["n", "ok", "xs", "c"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}
CASES = [
    (SamplingParams(json_schema=json.dumps(PERSON)), PERSON),
    (SamplingParams(json_schema=json.dumps(ORDER)), ORDER),
    (SamplingParams(json_object=True), ANY_OBJECT),
]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Thousands of small vector ops: intra-op threads only add overhead (30x on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smol(default_model):
    compiler = GrammarCompiler(
        default_model.tokenizer, default_model.config.vocab_size, default_model.config.eos_token_ids
    )
    yield default_model.tokenizer, compiler
    compiler.close()


@pytest.fixture(scope="module")
def tiny():
    """tests/pd.py's TINY model: the byte-level vocabulary (259 ids) under 320 logits."""
    tokenizer = Tokenizer.byte_level(320)
    compiler = GrammarCompiler(tokenizer, 320, (2,))
    yield tokenizer, compiler
    compiler.close()


def bias_on(tokenizer: Tokenizer, vocab_size: int, pick, amount: float) -> torch.Tensor:
    """+amount on the logits of the tokens whose text `pick` selects."""
    bias = torch.zeros(vocab_size)
    for i in range(tokenizer.vocab_size):
        if pick(tokenizer.decode([i], skip_special_tokens=False)):
            bias[i] = amount
    return bias


def closes_what_it_opens(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """A model that closes its strings, objects and arrays: +5 on the tokens holding a quote, "}" or
    "]". With flat random logits a free string runs for hundreds of tokens (on the default model's
    vocabulary ~48 800 ids may continue it, ~160 hold a quote)."""
    return bias_on(tokenizer, vocab_size, lambda text: any(c in text for c in '"}]'), 5.0)


def generate(compiler: GrammarCompiler, params: SamplingParams, seed: int, bias=None, cap: int = 600, record=None):
    """Seeded random logits (+bias), masked, sampled from the softmax, accepted, until EOS or `cap`
    tokens: (the tokens before EOS, whether EOS came). record: a list that gets each step's mask."""
    matcher = compiler.matcher(params)
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < cap:
        logits = torch.randn(compiler.vocab_size, generator=g)
        if bias is not None:
            logits += bias
        if record is not None:
            record.append(matcher.allowed())
        matcher.mask(logits)
        if record is not None:
            assert torch.equal(torch.isfinite(logits), record[-1])  # mask() leaves exactly allowed()
        ids = torch.isfinite(logits).nonzero().flatten()  # (sampling these alone: the same law, much faster)
        token = int(ids[torch.multinomial(torch.softmax(logits[ids], dim=-1), 1, generator=g)])
        matcher.accept(token)
        if token in compiler.eos_token_ids:
            assert matcher.done
            return out, True
        out.append(token)
    return out, False


def assert_valid(text: str, schema: dict) -> None:
    value = json.loads(text)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator(schema, format_checker=validator.FORMAT_CHECKER).validate(value)
    assert isinstance(value, dict)
    assert text == text.strip()  # no whitespace before the object or after it


@pytest.mark.parametrize(("params", "schema"), CASES, ids=["person", "nested-order", "json-object"])
def test_50_seeded_random_runs_on_the_default_vocabulary_end_in_valid_json(smol, params, schema):
    tokenizer, compiler = smol
    bias = closes_what_it_opens(tokenizer, compiler.vocab_size)
    lengths = []
    for seed in range(50):
        out, ended = generate(compiler, params, seed, bias)
        assert ended, f"seed {seed}: no EOS in {len(out)} tokens: {tokenizer.decode(out)[:200]!r}"
        assert_valid(tokenizer.decode(out), schema)
        lengths.append(len(out))
    assert len(set(lengths)) > 10  # 50 different runs, not one


@pytest.mark.parametrize(("params", "schema"), CASES, ids=["person", "nested-order", "json-object"])
def test_the_byte_level_vocabulary_with_padded_logits_ends_in_valid_json(tiny, params, schema):
    tokenizer, compiler = tiny
    bias = closes_what_it_opens(tokenizer, compiler.vocab_size)
    for seed in range(50):
        masks: list[torch.Tensor] = []
        out, ended = generate(compiler, params, seed, bias, cap=1500, record=masks)
        assert ended, f"seed {seed}: no EOS in {len(out)} tokens: {tokenizer.decode(out)[:200]!r}"
        assert_valid(tokenizer.decode(out), schema)
        allowed = torch.stack(masks)
        assert not allowed[:, 259:].any()  # the padding ids past the tokenizer's 259: never
        assert not allowed[:, :2].any()  # <|endoftext|>, <|im_start|>: special, never
        assert allowed[-1].nonzero().flatten().tolist() == [2]  # at the end: <|im_end|> (EOS) alone
        assert not allowed[:-1, 2].any()  # (the top-level object is complete only at the end)


def test_at_the_end_eos_alone_is_allowed_and_further_text_is_refused(smol):
    tokenizer, compiler = smol
    matcher = compiler.matcher(SamplingParams(json_schema=json.dumps(PERSON)))
    assert not matcher.accepting and not matcher.done
    matcher.accept_all(tokenizer.encode('{"name": "Ada", "age": 36, "color": "red", "tags": []}'))
    assert matcher.done and matcher.accepting and matcher.error is None
    assert matcher.allowed().nonzero().flatten().tolist() == [2] == [tokenizer.token_id("<|im_end|>")]
    logits = torch.zeros(compiler.vocab_size)
    matcher.mask(logits)
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [2]
    newline = tokenizer.encode("\n")[0]
    with pytest.raises(
        ValueError, match=rf"token {newline} is not allowed by the grammar here \(the output is complete"
    ):
        matcher.accept(newline)
    matcher.accept(2)
    assert matcher.done


def test_a_token_the_grammar_refuses_raises_and_leaves_the_state_as_it_was(smol):
    tokenizer, compiler = smol
    matcher = compiler.matcher(SamplingParams(json_schema=json.dumps(PERSON)))
    before = matcher.allowed()
    assert before.sum() > 0 and not before[tokenizer.encode("[")[0]]
    for token in (tokenizer.encode("[")[0], 2, compiler.vocab_size, -1):
        with pytest.raises(ValueError, match=f"token {token} is not allowed"):
            matcher.accept(token)
    assert torch.equal(matcher.allowed(), before)
    matcher.accept(tokenizer.encode("{")[0])
    assert not torch.equal(matcher.allowed(), before)


@pytest.mark.parametrize("k", [1, 7, 20])
def test_a_matcher_replaying_the_first_k_tokens_masks_every_later_step_as_the_original(smol, k):
    tokenizer, compiler = smol
    params = SamplingParams(json_schema=json.dumps(ORDER))
    masks: list[torch.Tensor] = []
    out, ended = generate(
        compiler, params, seed=3, bias=closes_what_it_opens(tokenizer, compiler.vocab_size), record=masks
    )
    assert ended and len(out) > 20
    replayed = compiler.matcher(params, prior_tokens=out[:k])
    for step in range(k, len(out)):
        assert torch.equal(replayed.allowed(), masks[step]), f"step {step}"
        replayed.accept(out[step])
    assert torch.equal(replayed.allowed(), masks[len(out)])
    assert replayed.done


def test_replaying_a_token_the_grammar_refuses_names_it(smol):
    tokenizer, compiler = smol
    params = SamplingParams(json_object=True)
    start, close = tokenizer.encode('{"a":'), tokenizer.encode("}")[0]
    assert len(start) == 3
    with pytest.raises(ValueError, match=rf"^token {close} \(#3\) is not allowed by the grammar here$"):
        compiler.matcher(params, prior_tokens=[*start, close, *tokenizer.encode("1}")])
    done = tokenizer.encode('{"a": 1}')
    assert len(done) == 6
    newline = tokenizer.encode("\n")[0]
    with pytest.raises(
        ValueError, match=rf"^token {newline} \(#7\) is not allowed by the grammar here \(the output is"
    ):
        compiler.matcher(params, prior_tokens=[*done, 2, newline])
    for prior in ([*done, 2], [*done, 2, 2]):  # (after EOS the mask allows EOS alone: so does accept)
        assert compiler.matcher(params, prior_tokens=prior).allowed().nonzero().flatten().tolist() == [2]


def test_whitespace_runs_are_bounded_so_a_whitespace_loving_model_still_finishes(smol, tiny, monkeypatch):
    params = SamplingParams(json_schema=json.dumps(NO_STRINGS))
    for tokenizer, compiler in (smol, tiny):
        bias = bias_on(tokenizer, compiler.vocab_size, lambda text: text != "" and text.isspace(), 8.0)
        for seed in range(10):
            out, ended = generate(compiler, params, seed, bias, cap=1500)
            assert ended
            text = tokenizer.decode(out)
            assert_valid(text, NO_STRINGS)
            runs = [len(r) for r in re.findall(r"[ \t\r\n]+", text)]
            assert max(runs) == MAX_WHITESPACE  # it takes all it may, no more
    # llguidance's default (any run of whitespace) never finishes here
    monkeypatch.setattr(kvbridge.common.text.schema, "JSON_OPTIONS", {"lenient": False})
    tokenizer, compiler = tiny
    unbounded = GrammarCompiler(tokenizer, 320, (2,))
    bias = bias_on(tokenizer, 320, lambda text: text != "" and text.isspace(), 8.0)
    for seed in range(3):
        out, ended = generate(unbounded, params, seed, bias, cap=1500)
        assert not ended and len(tokenizer.decode(out).strip()) < 60
    unbounded.close()


def test_mask_rows_equals_each_rows_own_mask_and_leaves_unconstrained_rows(smol):
    tokenizer, compiler = smol
    a = compiler.matcher(SamplingParams(json_object=True), prior_tokens=tokenizer.encode('{"key'))
    b = compiler.matcher(
        SamplingParams(json_schema=json.dumps(PERSON)), prior_tokens=tokenizer.encode('{"name": "x", "age": 4')
    )
    logits = torch.randn(3, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    a.mask(expected[0])
    b.mask(expected[2])
    compiler.mask_rows(logits, [a, None, b])
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all()
    # after '"age": 4': a digit, or whitespace, a comma, whitespace and the start of '"color":'
    after_age = re.compile(r'[0-9]|[ \t\r\n]{0,20}(,[ \t\r\n]{0,20}"?(c|co|col|colo|color|color"|color":)?)?')
    texts = {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)}
    expected_ids = sorted(i for i, text in texts.items() if text and after_age.fullmatch(text))
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == expected_ids
    assert len(expected_ids) == 123


def test_mask_writes_any_float_row_in_place_and_refuses_what_torch_refuses(tiny):
    tokenizer, compiler = tiny
    matcher = compiler.matcher(SamplingParams(json_object=True))
    brace = tokenizer.encode("{")  # (the only id allowed first)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        logits = torch.zeros(3, 320, dtype=dtype)
        matcher.mask(logits[1])  # a view: the tensor it views is written
        assert [torch.isfinite(row).nonzero().flatten().tolist() for row in logits] == [
            list(range(320)),
            brace,
            list(range(320)),
        ]
        columns = torch.zeros(320, 2, dtype=dtype).T  # strided rows
        matcher.mask(columns)
        assert torch.isfinite(columns).nonzero()[:, 1].tolist() == brace * 2
    with torch.inference_mode():
        frozen = torch.zeros(320)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        matcher.mask(frozen)
    with pytest.raises(ValueError, match="logits have 321 columns; this matcher's vocabulary is 320"):
        matcher.mask(torch.zeros(321))
    with pytest.raises(ValueError, match="a matcher appears in two rows"):
        compiler.mask_rows(torch.zeros(2, 320), [matcher, matcher])


def test_schema_problem_names_the_problem():
    assert schema_problem(json.dumps(PERSON)) is None
    assert schema_problem(json.dumps(ORDER)) is None
    assert schema_problem('{"type": "object"}') is None
    assert schema_problem('{"type": "object", "properties": {"a": }') == (
        "json_schema is not valid JSON: Expecting value at line 1 column 40 (char 39)"
    )
    assert schema_problem('["type", "object"]') == "json_schema must be a JSON object (a schema), got a JSON array"
    assert schema_problem("true") == "json_schema must be a JSON object (a schema), got a JSON boolean"
    assert schema_problem('{"type": "nosuchtype"}') == "json_schema: Invalid type: nosuchtype"
    assert (
        schema_problem('{"type": "array", "uniqueItems": true}') == 'json_schema: Unimplemented keys: ["uniqueItems"]'
    )
    assert schema_problem('{"not": {"type": "string"}}') == 'json_schema: Unimplemented keys: ["not"]'
    assert schema_problem('{"type": "integer", "minimum": 5, "maximum": 1}') == (
        "json_schema: Unsatisfiable schema: minimum (5) is greater than maximum (1)"
    )
    assert schema_problem('{"$ref": "#/$defs/missing"}') == "json_schema: Pointer '/$defs/missing' does not exist"
    assert schema_problem('{"type": "string", "pattern": "("}').startswith("json_schema: regex parse error:")
    deep = '{"type": "array", "items": ' * 200 + "{}" + "}" * 200
    assert schema_problem(deep).startswith("json_schema: recursion limit exceeded")
    big = json.dumps({"type": "object", "description": "x" * MAX_SCHEMA_CHARS})
    assert schema_problem(big) == f"json_schema is {len(big)} characters; at most {MAX_SCHEMA_CHARS}"
    assert all("\n" not in schema_problem(s) for s in ('{"type": "string", "pattern": "("}', "{", deep))


def test_a_rejected_schema_fails_its_compile_with_the_same_message(tiny):
    _, compiler = tiny
    params = SamplingParams(json_schema='{"type": "nosuchtype"}')
    with pytest.raises(ValueError, match=r"^json_schema: Invalid type: nosuchtype$"):
        compiler.compile(params).result(timeout=30)
    with pytest.raises(ValueError, match=r"^json_schema: Invalid type: nosuchtype$"):
        compiler.matcher(params)


def test_a_schema_compiles_once_and_the_cache_keeps_the_last_used():
    tokenizer = Tokenizer.byte_level(320)
    compiler = GrammarCompiler(tokenizer, 320, (2,), cache_size=2)
    person = SamplingParams(json_schema=json.dumps(PERSON))
    first = compiler.compile(person)
    assert compiler.compile(SamplingParams(json_schema=json.dumps(PERSON), temperature=1.0)) is first
    compiler.matcher(person)
    compiler.matcher(person, prior_tokens=tokenizer.encode("{"))
    assert compiler.compiles == 1
    compiler.matcher(SamplingParams(json_object=True))
    compiler.matcher(SamplingParams(json_object=True))
    assert compiler.compiles == 2
    compiler.compile(person)  # (person is now the most recent)
    compiler.compile(SamplingParams(json_schema=json.dumps(ORDER)))  # evicts json_object
    assert compiler.compiles == 3
    compiler.compile(person)
    assert compiler.compiles == 3
    compiler.compile(SamplingParams(json_object=True))
    assert compiler.compiles == 4
    with pytest.raises(ValueError, match="no structured output"):
        compiler.compile(SamplingParams())
    compiler.close()


def test_eos_ids_default_to_the_tokenizers_and_must_fit_the_vocabulary():
    tokenizer = Tokenizer.byte_level(320)
    compiler = GrammarCompiler(tokenizer, 320)
    assert compiler.eos_token_ids == (2,)
    compiler.close()
    with pytest.raises(ValueError, match=r"EOS ids \[400\] must be in \[0, vocab_size=320\)"):
        GrammarCompiler(tokenizer, 320, (400,))


def chain(n: int, link) -> dict:
    """$defs a0..a{n-1}: a_i = link(the $ref to a_{i+1}), the last an integer; the schema refers to a0."""
    defs = {f"a{i}": link({"$ref": f"#/$defs/a{i + 1}"}) for i in range(n - 1)}
    return {"$defs": {**defs, f"a{n - 1}": {"type": "integer"}}, "$ref": "#/$defs/a0"}


def options(m: int, key: str) -> dict:
    return {"anyOf": [{"type": "object", "properties": {key: {"const": i}}} for i in range(m)]}


REFUSE_IN_A_CHILD = """
import json, sys
from kvbridge.common.sampling import SamplingParams
from kvbridge.common.text.schema import schema_problem
from kvbridge.engine.grammar import GrammarCompiler
from kvbridge.common.text.tokenizer import Tokenizer
compiler = GrammarCompiler(Tokenizer.byte_level(320), 320, (2,))
out = []
for text in json.load(sys.stdin):
    try:
        compiler.compile(SamplingParams(json_schema=text)).result(timeout=60)
        compiled = "compiled"
    except ValueError as e:
        compiled = str(e)
    out.append([schema_problem(text), compiled])
print(json.dumps(out))
"""


def test_a_1500_long_allof_ref_chain_is_refused_by_the_check_and_the_compiler_and_nothing_crashes():
    """The reported schema (65 KB, JSON nesting 4) overflowed llguidance's stack: SIGSEGV in the
    router (schema_problem) and in every node (the front's check, the sampling rank's compile). Run
    in a child process so that a crash fails this test rather than ending the run."""
    import subprocess
    import sys

    compact = {"separators": (",", ":")}  # (as the router sends a response_format's schema on)
    reported = json.dumps(chain(1500, lambda ref: {"allOf": [ref]}), **compact)
    deep = json.dumps(chain(1000, lambda ref: {"allOf": [ref]}), **compact)  # (2,000 subschemas: under that limit)
    assert len(reported) == 65296 and MAX_SCHEMA_CHARS == 65536
    child = subprocess.run(
        [sys.executable, "-c", REFUSE_IN_A_CHILD], input=json.dumps([reported, deep]), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    nodes = f"json_schema has more than {MAX_SCHEMA_NODES} subschemas; at most {MAX_SCHEMA_NODES}"
    depth = (
        "json_schema nests subschemas up to 2000 deep, following its $refs (each counted once); "
        f"at most {MAX_SCHEMA_DEPTH}"
    )
    assert json.loads(child.stdout) == [[nodes, nodes], [depth, depth]]


def test_schema_depth_counts_ref_targets_and_stops_at_the_limit():
    assert (MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, MAX_SCHEMA_COMBINATIONS) == (256, 2048, 256)
    assert schema_problem(json.dumps(chain(255, lambda ref: ref))) is None  # the root, then 255 targets
    assert schema_problem(json.dumps(chain(256, lambda ref: ref))) == (
        "json_schema nests subschemas up to 257 deep, following its $refs (each counted once); at most 256"
    )
    by_property = chain(130, lambda ref: {"type": "object", "properties": {"x": ref}})  # two levels a link
    assert schema_problem(json.dumps(by_property)).startswith("json_schema nests subschemas up to 260 deep")
    kids = {"type": "array", "items": {"$ref": "#/$defs/node"}}
    tree = {  # recursion: each $ref counted once, however deep the output nests
        "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": kids}}},
        "$ref": "#/$defs/node",
    }
    assert schema_problem(json.dumps(tree)) is None
    compiler = GrammarCompiler(Tokenizer.byte_level(320), 320, (2,))
    matcher = compiler.matcher(SamplingParams(json_schema=json.dumps(tree)))
    matcher.accept_all(Tokenizer.byte_level(320).encode('{"v": 1, "kids": [{"v": 2, "kids": []}]}'))
    assert matcher.done
    compiler.close()


def test_under_a_scope_each_ref_occurrence_may_reach_the_tallest_subschema():
    """With $id below the root a $ref resolves against its scope (llguidance does), so each occurrence
    counts as reaching anywhere: the tallest subschema (3: array, items, property). 2 + 84 x 3 = 254."""

    def scoped(n: int) -> str:
        return json.dumps({
            "$defs": {"s": {"$id": "urn:s", "type": "array", "items": {"type": "object", "properties": {"x": {}}}}},
            "properties": {f"p{i}": {"$ref": "urn:s"} for i in range(n)},
        })  # fmt: skip

    assert schema_problem(scoped(84)) is None
    assert schema_problem(scoped(85)) == (
        "json_schema nests subschemas up to 257 deep, following its $refs (each counted once); at most 256"
    )


def test_subschemas_are_counted_up_to_the_limit():
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(MAX_SCHEMA_NODES - 1)}}
    assert schema_problem(json.dumps(wide)) is None  # the root and 2,047 properties
    wide["properties"]["one-more"] = {}
    assert schema_problem(json.dumps(wide)) == "json_schema has more than 2048 subschemas; at most 2048"


@pytest.mark.parametrize(
    ("schema", "refused"),
    [
        ({"allOf": [options(16, "a"), options(16, "b")]}, False),  # 256
        ({"allOf": [options(16, "a"), options(17, "b")]}, True),  # 272
        ({"allOf": [{"properties": {"x": options(16, "a")}}, {"properties": {"x": options(17, "b")}}]}, True),
        ({"allOf": [{"properties": {"x": options(64, "a")}}, {"properties": {"y": options(64, "b")}}]}, False),
        ({"allOf": [{"additionalProperties": options(16, "a")}, {"properties": {"y": options(17, "b")}}]}, True),
        ({"properties": {"x": options(16, "a")}, "anyOf": [{"properties": {"x": options(17, "b")}}, True]}, True),
        ({"anyOf": [options(200, "a"), options(200, "b")]}, False),  # (a union adds: 400 options, no product)
        ({"allOf": [{"enum": list(range(300))}, {"enum": list(range(300))}]}, False),  # (enums: llguidance's budget)
    ],
    ids=["16x16", "16x17", "16x17-in-a-property", "64x64-apart", "additional-meets-named", "keywords-together",
         "anyOf-of-anyOf", "enums"],
)  # fmt: skip
def test_options_one_intersection_multiplies_are_bounded(schema, refused):
    """64 x 64 object options under one property took llguidance 4 s; disjoint properties multiply nothing."""
    message = (
        "json_schema intersects more than 256 anyOf/oneOf options in one allOf (or one schema's keywords "
        "together); at most 256"
    )
    assert (schema_problem(json.dumps(schema)) == message) is refused
