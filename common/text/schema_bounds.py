"""Bounds on a JSON schema's shape, checked before llguidance compiles it. Pure: no llguidance, no torch.

llguidance compiles a schema recursively, on the caller's stack: each subschema inside the frame of
the one holding it, and a `$ref`'s target (once per URI) inside the frame of the subschema holding
the `$ref`. A chain of `$ref`s thus nests frames as deep as the chain is long, whatever the JSON's
own nesting (serde stops that at 128): 1,500 chained `allOf`/`$ref` definitions, 65 KB of JSON,
overflow an 8 MiB stack and the process dies with SIGSEGV. An intersection (`allOf`, or the
applicators of one schema taken together) multiplies the anyOf/oneOf options of its parts: 64 x 64
object options take seconds to compile. So, before llguidance sees a schema:

    bounds_problem(schema) -> str | None     schema: the parsed JSON object; None when within bounds

MAX_SCHEMA_NODES      subschemas (JSON objects in schema places: properties' values, items, allOf
                      branches, $defs' entries, ...) in the document.
MAX_SCHEMA_DEPTH      an upper bound on llguidance's compile depth: the containment height of the root,
                      plus, for each distinct `$ref` string that one path of compiles can follow, the
                      height of its target. Strings in a recursive cycle (a tree's node referring to
                      itself) are counted once each, so recursive schemas pass. A `$ref` this module
                      cannot resolve itself (not a local "#/..." pointer, or a document with `$id` or
                      `$anchor` below its root) counts as reaching anywhere: the height of the
                      document's tallest subschema, per occurrence. At ~3.5 KB of stack per level,
                      256 levels take ~1 MB: safe on a 2 MiB thread stack.
MAX_SCHEMA_COMBINATIONS  options one intersection forms: the product, over the parts an allOf (or a
                      schema's keywords) intersects, of their anyOf/oneOf options at the top and at
                      each property name, items, ... (a heuristic of llguidance's cost; enum and type
                      lists are cheap for it and not counted). llguidance's own budget (50,000 nodes)
                      bounds what this misses.

Every walk here is iterative and linear in the document's size (at most MAX_SCHEMA_NODES subschemas
are numbered), so the check is cheap on an event loop: 10-40 ms at 2,048 subschemas on a busy host.
"""

from __future__ import annotations

from urllib.parse import unquote

MAX_SCHEMA_NODES = 2048  # subschemas in one schema
MAX_SCHEMA_DEPTH = 256  # nested compiles, $refs followed (see above)
MAX_SCHEMA_COMBINATIONS = 256  # options one allOf (or one schema's keywords) combines

SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")  # name -> schema
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")  # a list of schemas ("items": drafts <= 2019)
SCHEMA_ONES = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "contentSchema",
)
DEFINITIONS = ("$defs", "definitions")  # compiled only as a $ref's target
SCOPING = frozenset(("$id", "id", "$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef", "$recursiveAnchor"))


def bounds_problem(schema: dict) -> str | None:
    """None when `schema` (a JSON object) is within MAX_SCHEMA_NODES, MAX_SCHEMA_DEPTH and
    MAX_SCHEMA_COMBINATIONS; else a message naming the limit."""
    doc = _Document(schema)
    if doc.too_many:
        return f"json_schema has more than {MAX_SCHEMA_NODES} subschemas; at most {MAX_SCHEMA_NODES}"
    depth = doc.depth_bound()
    if depth > MAX_SCHEMA_DEPTH:
        return (
            f"json_schema nests subschemas up to {depth} deep, following its $refs (each counted once); "
            f"at most {MAX_SCHEMA_DEPTH}"
        )
    if doc.combinations() > MAX_SCHEMA_COMBINATIONS:
        return (
            f"json_schema intersects more than {MAX_SCHEMA_COMBINATIONS} anyOf/oneOf options in one allOf "
            f"(or one schema's keywords together); at most {MAX_SCHEMA_COMBINATIONS}"
        )
    return None


def _subschemas(node: dict) -> tuple[list[dict], list[dict]]:
    """(the subschemas compiled inside `node`, its $defs' entries): JSON objects only (a boolean
    schema is a leaf)."""
    inside, defs = [], []
    for key, value in node.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            (defs if key in DEFINITIONS else inside).extend(v for v in value.values() if isinstance(v, dict))
        elif key in SCHEMA_LISTS and isinstance(value, list):
            inside.extend(v for v in value if isinstance(v, dict))
        elif key in SCHEMA_ONES and isinstance(value, dict):
            inside.append(value)
    return inside, defs


def _names_scope(node: dict) -> bool:
    return any(isinstance(node[k], str) for k in SCOPING.intersection(node))


def _pointer(root: dict, ref: str) -> object:
    """The value a local JSON pointer ("#", "#/a/b~1c/0") names; KeyError if none."""
    path = unquote(ref[1:])
    if not path:
        return root
    if not path.startswith("/"):
        raise KeyError(ref)
    node: object = root
    for part in path[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(ref)
    return node


class _Document:
    """The schema's subschemas (numbered in `nodes`), their containment and $ref edges."""

    ANY = -1  # a $ref resolved here to no known place: it may reach any subschema

    def __init__(self, root: dict):
        self.root = root
        self.nodes: list[dict] = []
        self.index: dict[int, int] = {}  # id(JSON object) -> its number
        self.inside: list[list[int]] = []  # compiled children of each node
        self.too_many = False
        self.scoped = False  # $id or $anchor below the root: $refs resolve by scope, not by text alone
        self.options = False  # some subschema has anyOf or oneOf
        self.refs: dict[int, tuple[object, int | None]] = {}  # node -> (its $ref's key, target node)
        self._add_tree(root)
        i = 0
        while i < len(self.nodes) and not self.too_many:  # (targets found here may add trees)
            self._resolve(i)
            i += 1
        if self.scoped:
            self.refs = {i: ((i, key), self.ANY) for i, (key, _) in self.refs.items()}  # (a URI per occurrence)

    def _add_tree(self, top: dict) -> None:
        stack, children = [top], []
        while stack:
            node = stack.pop()
            if id(node) in self.index:
                continue
            if len(self.nodes) >= MAX_SCHEMA_NODES:
                self.too_many = True
                return
            self.index[id(node)] = len(self.nodes)
            self.nodes.append(node)
            if not SCOPING.isdisjoint(node) and node is not self.root and _names_scope(node):
                self.scoped = True
            self.options = self.options or "anyOf" in node or "oneOf" in node
            inside, defs = _subschemas(node)
            children.append(inside)
            stack += inside + defs
        self.inside += [[self.index[id(c)] for c in inside] for inside in children]  # (all numbered now)

    def _resolve(self, i: int) -> None:
        ref = self.nodes[i].get("$ref")
        if not isinstance(ref, str):
            return
        if not ref.startswith("#"):
            self.refs[i] = ((i, ref), self.ANY)  # (relative to the document's $id: one URI per occurrence)
            return
        try:
            target = _pointer(self.root, ref)
        except KeyError:
            self.refs[i] = (ref, self.ANY)
            return
        if isinstance(target, dict):
            self._add_tree(target)
            self.refs[i] = (ref, self.index.get(id(target)))
        else:
            self.refs[i] = (ref, None)  # a boolean schema (a leaf), or an error for llguidance

    def heights(self) -> list[int]:
        """Each node's containment height: 1 + its tallest compiled child's (leaves: 1)."""
        height = [0] * len(self.nodes)
        order, stack = [], [i for i in range(len(self.nodes))]
        seen = [False] * len(self.nodes)
        while stack:  # post-order over the containment forest
            i = stack.pop()
            if i >= 0:
                if seen[i]:
                    continue
                seen[i] = True
                stack.append(~i)
                stack += [c for c in self.inside[i] if not seen[c]]
            else:
                order.append(~i)
        for i in order:
            height[i] = 1 + max((height[c] for c in self.inside[i]), default=0)
        return height

    def depth_bound(self) -> int:
        """The root's height plus the heaviest path of distinct $ref strings, each weighing its target's
        height (ANY: the tallest node's), over the graph node -> child, node -> its $ref string ->
        target; strongly connected parts weigh the sum of their strings."""
        height = self.heights()
        tallest = max(height)
        n = len(self.nodes)
        keys = {key: n + 1 + k for k, key in enumerate(dict.fromkeys(key for key, _ in self.refs.values()))}
        weight = [0] * (n + 1 + len(keys))  # nodes, ANY (n), then strings
        edges: list[list[int]] = [list(c) for c in self.inside] + [[]] + [[] for _ in keys]
        for i, (key, target) in self.refs.items():
            s = keys[key]
            edges[i].append(s)
            if target == self.ANY:
                weight[s], edges[s] = tallest, [n]
                edges[n] = list(range(n))
            elif target is not None:
                weight[s], edges[s] = height[target], [target]
            else:
                weight[s] = 1
        return height[0] + _heaviest_path(edges, weight, 0)

    def combinations(self) -> int:
        """The most options one intersection forms (see MAX_SCHEMA_COMBINATIONS), capped just past it.
        Each node's fan is computed after its parts' (iterative post-order from the root; a part still
        in progress, a cycle, counts as one option)."""
        if not self.options:
            return 0
        fans: list[dict[str, int] | None] = [None] * len(self.nodes)
        worst, entered, stack = 0, [False] * len(self.nodes), [0]
        while stack:
            i = stack.pop()
            if i >= 0:
                if entered[i]:
                    continue
                entered[i] = True
                stack.append(~i)
                target = self.refs.get(i, (None, None))[1]
                stack += [c for c in self.inside[i] if not entered[c]]
                if target not in (None, self.ANY) and not entered[target]:
                    stack.append(target)
            else:
                fans[~i], formed = self._fan(~i, fans)
                worst = max(worst, formed)
        return worst

    def _fan(self, i: int, fans: list[dict[str, int] | None]) -> tuple[dict[str, int], int]:
        """(node i's options at each place, the options its intersection forms: 0 if none). Places: ""
        its own (anyOf/oneOf options, multiplied over its intersected parts), "p:name" a property's,
        "items", "*" (additionalProperties, patternProperties...: they meet every name); each value
        is the most options anywhere below that place (1 where a place is not named)."""
        cap = MAX_SCHEMA_COMBINATIONS + 1

        def fan(child: object) -> dict[str, int]:
            return (fans[self.index[id(child)]] or {}) if isinstance(child, dict) else {}

        def deepest(child: object) -> int:
            return max(fan(child).values(), default=1)

        own: dict[str, int] = {}
        parts = [own]
        for key, value in self.nodes[i].items():
            if key == "properties" and isinstance(value, dict):
                own.update((f"p:{name}", deepest(c)) for name, c in value.items())
            elif key in ("items", "prefixItems"):
                own["items"] = max([own.get("items", 1), *(deepest(c) for c in _listed(value))])
            elif key in SCHEMA_ONES or key == "patternProperties":
                members = value.values() if key == "patternProperties" and isinstance(value, dict) else [value]
                own["*"] = max([own.get("*", 1), *(deepest(c) for c in members)])
            elif key == "allOf":
                parts += [fan(m) for m in _listed(value)]
            elif key in ("anyOf", "oneOf") and _listed(value):
                either = _merge([fan(m) for m in _listed(value)], cap)
                either[""] = min(sum(fan(m).get("", 1) for m in _listed(value)), cap)
                parts.append(either)
        target = self.refs.get(i, (None, None))[1]
        if target not in (None, self.ANY):
            parts.append(fans[target] or {})
        out = _merge(parts, cap)
        out[""] = _product([p.get("", 1) for p in parts], cap)
        wide = [p for p in parts if max(p.values(), default=1) > 1]
        formed = 0
        if len(wide) > 1:
            formed = max(_product([_at(p, k) for p in wide], cap) for k in {k for p in wide for k in p})
            out[""] = max(out[""], formed)
        return {k: v for k, v in out.items() if v > 1}, formed


def _at(fan: dict[str, int], place: str) -> int:
    """A fan's options at a place; a property it does not name meets its additionalProperties ("*")."""
    return fan.get(place, fan.get("*", 1) if place.startswith("p:") else 1)


def _listed(value: object) -> list:
    """A schema keyword's value as a list of schemas: a list's members, a single one, or none."""
    if isinstance(value, list):
        return value
    return [value] if isinstance(value, (dict, bool)) else []


def _merge(fans: list[dict[str, int]], cap: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for fan in fans:
        for k, v in fan.items():
            out[k] = min(max(out.get(k, 1), v), cap)
    return out


def _product(values: list[int], cap: int) -> int:
    out = 1
    for v in values:
        out = min(out * v, cap)
    return out


def _heaviest_path(edges: list[list[int]], weight: list[int], start: int) -> int:
    """The heaviest path from `start`, where a strongly connected component weighs the sum of its
    nodes' weights (an upper bound on any simple path's weight). Iterative Tarjan: components come
    out after every component they reach, so each one's best is known when it is closed."""
    n = len(edges)
    index, low, comp = [-1] * n, [0] * n, [-1] * n
    on_stack = [False] * n
    best: list[int] = []  # per component
    stack, counter, work = [], 0, [(start, 0)]
    while work:
        v, k = work.pop()
        if k == 0:
            index[v] = low[v] = counter
            counter += 1
            stack.append(v)
            on_stack[v] = True
        if k < len(edges[v]):
            work.append((v, k + 1))
            w = edges[v][k]
            if index[w] < 0:
                work.append((w, 0))
            elif on_stack[w]:
                low[v] = min(low[v], index[w])
            continue
        for w in edges[v]:  # (its children are done: fold in the lows of those still open)
            if on_stack[w]:
                low[v] = min(low[v], low[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack[w] = False
                comp[w] = len(best)
                members.append(w)
                if w == v:
                    break
            below = max((best[comp[u]] for m in members for u in edges[m] if comp[u] != len(best)), default=0)
            best.append(sum(weight[m] for m in members) + below)
    return best[comp[start]]
