"""The measured dispatch rule: a small decision tree over a case's shape, fitted to benchmark times, that orders
the backends for any case, measured or not.

`python -m attnops tune` times every backend on a grid of real models' head shapes, formats and batch shapes on
one GPU and fits the tree (`fit`): each split is the question about the case (its format, GQA group, head dim,
batch, ...) that most reduces the time lost to choosing the slower backend, summed over the measured cases; each
leaf orders the backends by the time they lose in its cases. The tree is stored in attnops/tables/sm_XY.json and
read by dispatch (`decide`). A case the grid never measured (another head shape, another batch) follows the same
questions to the leaf of the measured cases most like it, so the fallback is measured too, not a habit.

Everything here reads shapes only (AttentionCase fields), never tensor data, so a choice is fixed per shape:
in a CUDA graph, per captured bucket.
"""
from __future__ import annotations

import math

from .cases import AttentionCase, MLACase

# (name, kind): "cat" splits by equality, "num" by a threshold. The order breaks ties between equal splits.
FEATURES = (("kv_format", "cat"), ("shape_class", "cat"), ("scale_kind", "cat"), ("group", "num"),
            ("head_dim", "num"), ("num_kv_heads", "num"), ("batch", "num"), ("work", "num"), ("max_kv_len", "num"),
            ("rows", "num"))
TOLERANCE = 1.03  # a backend within 3% of the fastest counts as a right choice in the leaf statistics


def features(case: AttentionCase | MLACase) -> dict:
    """What the rule may ask about a case. `work` is the (sequence, KV head) pairs: the parallelism a kernel has
    before it splits the keys; `rows` the query rows each pair brings (the GQA group times the query tokens a
    sequence): a verify kernel's tile height. A latent-attention case is read as the MQA it is (one latent row a
    token, shared by every query head: group = heads, head_dim = R); it has a rule of its own (other backends)."""
    if isinstance(case, MLACase):
        return dict(kv_format=case.kv_format, shape_class=case.shape_class,
                    scale_kind="per_tensor" if case.kv_format == "fp8_e4m3" else "none", group=case.num_heads,
                    head_dim=case.latent_dim, num_kv_heads=1, batch=case.batch, work=case.batch,
                    max_kv_len=case.max_kv_len, rows=case.num_heads)
    return dict(kv_format=case.kv_format, shape_class=case.shape_class, scale_kind=case.scale_kind,
                group=case.num_q_heads // case.num_kv_heads, head_dim=case.head_dim, num_kv_heads=case.num_kv_heads,
                batch=case.batch, work=case.batch * case.num_kv_heads, max_kv_len=case.max_kv_len,
                rows=case.num_q_heads // case.num_kv_heads * case.q_per_seq)


def _cost(times: dict, name: str) -> float:
    """Log of the time lost by choosing `name` for one case (0 for its fastest backend)."""
    return math.log(times[name] / min(times.values()))


def _leaf(samples, names) -> dict:
    lost = {n: sum(_cost(t, n) for _, t in samples) for n in names}
    order = sorted(names, key=lambda n: (lost[n], names.index(n)))
    first = order[0]

    def slower(n):  # over the cases both serve; None where no case has both
        both = [t for f, t in samples if not {n, first} & f.get(_DECLINED, set())]
        if not both:
            return None
        return round(math.exp(sum(math.log(t[n] / t[first]) for t in both) / len(both)), 4)

    return dict(order=order, cases=len(samples),
                right=sum(1 for _, t in samples if t[first] <= TOLERANCE * min(t.values())),
                slower=[slower(n) for n in order[1:]])


def _node_cost(samples, names) -> float:
    return min(sum(_cost(t, n) for _, t in samples) for n in names)


def _splits(samples):
    for name, kind in FEATURES:
        values = sorted({f[name] for f, _ in samples})
        if kind == "cat":
            for v in values:
                yield name, "==", v
        else:
            for a, b in zip(values, values[1:]):
                yield name, "<=", round(math.sqrt(a * b), 3) if a > 0 else (a + b) / 2


def _goes_yes(value, op: str, threshold) -> bool:
    return value == threshold if op == "==" else value <= threshold


# A backend with no time for a case declines it (it cannot serve that format, say): in the fit it costs the case
# UNSERVED x its slowest measured backend, so that a leaf puts it last (dispatch would pass over it anyway).
UNSERVED = 4.0
_DECLINED = "_declined"  # (a sample's features also carry the set of backends that decline it; no rule asks)


def _fill(features: dict, times: dict, names) -> tuple[dict, dict]:
    slowest = max(times[n] for n in names if n in times)
    declined = {n for n in names if n not in times}
    return ({**features, _DECLINED: declined},
            {n: times[n] if n in times else UNSERVED * slowest for n in names})


def fit(samples, names, max_depth: int = 9, min_gain: float = 0.01, lookahead: int = 1) -> dict:
    """A tree from `samples` [(features dict, {backend: us})], each timed on some backends of `names` (one with
    no time declines the case: UNSERVED). A split is kept only if it saves at least `min_gain` (log units, summed
    over cases: 0.01 is 1% of one case). `lookahead`: the further splits a question is judged with (its cost grows
    as the partitions to that power: 2 for a few hundred cases, such as latent attention's)."""
    samples = [_fill(f, t, names) for f, t in samples if any(n in t for n in names)]
    if not samples:
        raise ValueError("attnops.rules.fit: no case was timed on any backend of " + ", ".join(names))
    return _fit(samples, list(names), max_depth, min_gain, lookahead)


def _partitions(samples):
    for feature, op, value in _splits(samples):
        yes = [s for s in samples if _goes_yes(s[0][feature], op, value)]
        if 0 < len(yes) < len(samples):
            yield feature, op, value, yes, [s for s in samples if not _goes_yes(s[0][feature], op, value)]


def _best_cost(samples, names, splits: int) -> float:
    """The least cost `samples` reach with at most `splits` more levels of questions."""
    cost = _node_cost(samples, names)
    if splits > 0 and cost > 0:
        for *_, yes, no in _partitions(samples):
            cost = min(cost, _best_cost(yes, names, splits - 1) + _best_cost(no, names, splits - 1))
    return cost


def _fit(samples, names, depth, min_gain, lookahead) -> dict:
    """Greedy, with `lookahead` splits of look-ahead: a question that only pays with a further one (bf16 splits by
    batch, fp8 does not) is still asked."""
    here = _node_cost(samples, names)
    best = None
    if depth > 0 and here > 0:
        ahead_splits = min(lookahead, depth - 1)
        for feature, op, value, yes, no in _partitions(samples):
            gain = here - _node_cost(yes, names) - _node_cost(no, names)
            ahead = here - _best_cost(yes, names, ahead_splits) - _best_cost(no, names, ahead_splits)
            score = (round(max(gain, ahead), 9), round(gain, 9))
            if max(gain, ahead) >= min_gain and (best is None or score > best[0]):
                best = (score, feature, op, value, yes, no)
    if best is None:
        return _leaf(samples, names)
    _, feature, op, value, yes, no = best
    return dict(feature=feature, op=op, value=value, yes=_fit(yes, names, depth - 1, min_gain, lookahead),
                no=_fit(no, names, depth - 1, min_gain, lookahead))


def decide(rule: dict, f: dict) -> tuple[dict, list[str]]:
    """(the leaf `f` falls in, the questions on the way there as text)."""
    path = []
    node = rule
    while "order" not in node:
        value = f.get(node["feature"])
        yes = value is not None and _goes_yes(value, node["op"], node["value"])
        if node["op"] == "==":
            path.append(f"{node['feature']} {'==' if yes else '!='} {node['value']}")
        else:
            path.append(f"{node['feature']} {'<=' if yes else '>'} {node['value']:g}")
        node = node["yes" if yes else "no"]
    return node, path


def describe_leaf(leaf: dict) -> str:
    order = leaf["order"]
    text = (f"{' > '.join(order)} (leaf of {leaf['cases']} measured cases; {order[0]} within "
            f"{round((TOLERANCE - 1) * 100)}% of the fastest in {leaf['right']}")
    for name, ratio in zip(order[1:], leaf["slower"]):
        text += (f"; {name} {ratio:.2f}x its time by geometric mean" if ratio is not None
                 else f"; {name} declines these cases")
    return text + ")"


def render(rule: dict, indent: str = "") -> str:
    """The tree as indented text (for `tune` and `info`)."""
    if "order" in rule:
        return f"{indent}-> {describe_leaf(rule)}\n"
    yes = f"{rule['feature']} {rule['op']} {rule['value']}"
    return (f"{indent}if {yes}:\n{render(rule['yes'], indent + '    ')}"
            f"{indent}else:\n{render(rule['no'], indent + '    ')}")
