"""L2 cache hints on the sparse MLA gathers' ``cp.async``, added to the PTX Triton emits.

FlashMLA's sm90 sparse prefill issues each 16-byte piece of a gathered K/V row as
``cp.async.cg.shared.global.L2::cache_hint.L2::256B [dst], [src], 16, src-size, policy;`` with
``policy`` from ``createpolicy.fractional.L2::evict_last.b64 policy, 1.0;``: neighbouring queries
pick many of the same rows (and at h_q 128 two CTAs gather every row), so rows are worth keeping
in L2, and each copy asks L2 to fetch the 256 bytes around it, so that one DRAM request serves
the next copies of the row. Our Gluon kernels cannot say so themselves: on sm_90, Triton 3.6 lowers
``async_copy_global_to_shared`` to ``cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10,
%r2;`` and drops its ``eviction_policy``, and Gluon's inline asm takes register operands only,
so it cannot issue a copy into shared memory.

So the hint goes in after code generation. A kernel that wants it runs ``policy_asm(hint)``
once in its gather partition as inline asm: a ``createpolicy`` into a 64-bit register whose PTX
line carries a marker comment naming the hint. ``install`` wraps Triton's "ptx" stage (its
stages-inspection hook), and ``rewrite_ptx`` then gives every masked ``cp.async`` in each
``.entry`` that is registered and carries the marker the hint's qualifiers and the marker's
register. Masked copies are the ones with a register src-size (Triton's zero-fill for a
false mask): the K/V gathers, which zero-fill invalid indices. Q's copies have no mask (src-size
is the constant ``0x10``), so they keep no hint (FlashMLA loads Q by TMA, also without one).
A cache hint changes only which lines L2 keeps and how much it fetches, never the bytes copied,
so a hinted kernel's results equal the unhinted one's bit for bit.

ptxas (12.8 and 13.0, sm_90) miscompiles a hinted copy whose shared address is a uniform part
plus a per-thread one (the seesaw's and the FP8 form's stage bases): it picks the
``LDGSTS [Rx+URy], desc[URz]`` form, whose encoded uniform registers (``UR0``, ``desc[UR1]``) no
instruction writes, and the hardware traps ("illegal instruction"; the split kernel's addresses
have no uniform part, so it escaped; IST-DASLab/marlin#44 and triton-lang/triton#11660 report
the same ptxas bug). So the pass also makes each hinted copy's shared address opaque to that
split: after each definition of the root of its address chain (the first register of
``add.s32 %rX, %rY, imm`` chains among the hinted copies' addresses) it puts the identity
``prmt.b32 %r, %r, %r, 0x3210;`` (a handful a tile, no more SASS otherwise), which ptxas does not
see through, so the address stays in a general register and the copy takes the policy pair as its
``desc`` (``undefined_uniform_reads`` checks a binary's SASS for the bug). "256b" alone carries no
cache-policy operand and is not affected.

Hinted and unhinted compiles do not collide in Triton's cache: the kernel gets the marker
asm as a constexpr, which is part of the cache key, and the marker holds ``_VERSION``, so a
change to the rewrite's output (bump it) does not reuse binaries cached by an older one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["HINTS", "HintError", "policy_asm", "rewrite_ptx", "hinted_copies", "install",
           "undefined_uniform_reads"]

_VERSION = 3  # 3: hinted copies' shared addresses opaque (ptxas's uniform-address bug)
_MARK = "glm_dsa.gather_hint"
_EVICT_LAST = "createpolicy.fractional.L2::evict_last.b64 $0, 1.0;"  # FlashMLA's policy
# Hint name -> (the qualifiers after ``cp.async.{ca,cg}.shared.global``, whether the copy takes
# the marker's register as its cache-policy operand). PTX ISA: ``cp.async.cg.shared.global
# {.level::cache_hint}{.level::prefetch_size} [dst], [src], 16{, src-size}{, cache-policy};``
# (``.ca`` the same with cp-size 4, 8 or 16).
# "evict_last_256b" is FlashMLA's form; the other two say which half of it pays.
HINTS: dict[str, tuple[str, bool]] = {
    "evict_last_256b": (".L2::cache_hint.L2::256B", True),
    "evict_last": (".L2::cache_hint", True),
    "256b": (".L2::256B", False),
}

_ENTRY = re.compile(r"^(?:\.visible[ \t]+|\.weak[ \t]+)?\.entry[ \t]+([A-Za-z_$][\w$]*)", re.M)
_MARKER = re.compile(r"^[ \t]*(?:createpolicy\.fractional\.L2::evict_last\.b64|mov\.b64)[ \t]+"
                     rf"(?P<reg>%rd\d+),[^\n]*//[ \t]*{re.escape(_MARK)}=(?P<hint>\w+) "
                     r"v(?P<version>\d+)[ \t]*$", re.M)
# Triton 3.6's cp.async as its inline asm prints it: ``cp.async.cg.shared.global [ %r51 + 0 ],
# [ %rd38 + 0 ], 0x10, %r50;`` (``ca`` and ``0x4`` for 4-byte copies); ``hint`` and ``policy``
# are what a rewrite added.
_COPY = re.compile(r"^(?P<head>[ \t]*cp\.async\.(?:ca|cg)\.shared\.global)(?P<hint>(?:\.L2::\w+)*)"
                   r"(?P<ops>[ \t]+\[[^\]\n]+\],[ \t]*\[[^\]\n]+\],[ \t]*(?:0x[0-9a-fA-F]+|\d+)),"
                   r"[ \t]*(?P<size>%r\d+)(?:,[ \t]*(?P<policy>%rd\d+))?;", re.M)
_DST = re.compile(r"^\[[ \t]*(%r\d+)[ \t]*\+[ \t]*0[ \t]*\]")
_ADD_IMM = re.compile(r"^[ \t]*add\.s32[ \t]+(%r\d+),[ \t]*(%r\d+),[ \t]*-?\d+;", re.M)
_OPAQUE = "prmt.b32 \t{0}, {0}, {0}, 0x3210; // glm_dsa: opaque address"


class HintError(RuntimeError):
    """A marked kernel's PTX in a form the rewrite does not know: nothing to hint, or markers it
    cannot tell apart. Raised rather than leaving a kernel that asked for a hint without one."""


def policy_asm(hint: str) -> str:
    """The inline asm a kernel runs once (``"=l"``, no inputs, not pure) for ``hint``: the
    cache policy (an unused zero where the hint has none) and the marker; ``""`` for "none"."""
    if hint == "none":
        return ""
    if hint not in HINTS:
        raise ValueError(f"gather_hint must be 'none' or one of {sorted(HINTS)}, got {hint!r}")
    setup = _EVICT_LAST if HINTS[hint][1] else "mov.b64 $0, 0;"
    return f"{setup} // {_MARK}={hint} v{_VERSION}"


def _entries(ptx: str) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` of each ``.entry`` (a section runs to the next entry)."""
    found = list(_ENTRY.finditer(ptx))
    ends = [m.start() for m in found[1:]] + [len(ptx)]
    return [(m.group(1), m.start(), end) for m, end in zip(found, ends)]


def _rewrite_entry(name: str, text: str) -> str:
    marks = list(_MARKER.finditer(text))
    if not marks:
        return text
    if len(marks) > 1:
        raise HintError(f"{name}: {len(marks)} {_MARK} markers, expected one (the gather's policy)")
    mark = marks[0]
    hint, reg = mark["hint"], mark["reg"]
    if int(mark["version"]) != _VERSION or hint not in HINTS:
        raise HintError(f"{name}: marker {hint} v{mark['version']} is not one of this rewrite's "
                        f"(v{_VERSION}: {sorted(HINTS)})")
    qualifiers, with_policy = HINTS[hint]
    policy = reg if with_policy else None
    copies = list(_COPY.finditer(text))
    if not copies:
        raise HintError(f"{name} asks for gather_hint {hint} but has no cp.async with a "
                        "register src-size (the masked gather copies) to give it to")
    out, pos = [], 0
    hinted = []
    for m in copies:
        if m["hint"] == qualifiers and m["policy"] == policy:
            continue  # rewritten before: the pass is idempotent
        if m["hint"] or m["policy"]:
            raise HintError(f"{name}: a cp.async already carries a hint other than {hint}'s: "
                            f"{m.group(0).strip()}")
        if m.start() < mark.start():
            raise HintError(f"{name}: a masked cp.async precedes the {_MARK} marker, so the "
                            f"policy register {reg} may not be set there: {m.group(0).strip()}")
        hinted.append(m)
        out += [text[pos:m.start()], m["head"], qualifiers, m["ops"], ", ", m["size"]]
        out += [", ", policy, ";"] if policy else [";"]
        pos = m.end()
    text = "".join(out) + text[pos:]
    return _opaque_addresses(name, text, hinted) if policy and hinted else text


def _opaque_addresses(name: str, text: str, copies: list[re.Match]) -> str:
    """``text`` with the identity ``prmt`` after each definition of the roots of the hinted
    ``copies``' shared addresses (the module docstring: ptxas's uniform-address bug)."""
    dsts = []
    for m in copies:
        dst = _DST.match(m["ops"].strip())
        if dst is None:
            raise HintError(f"{name}: a hinted cp.async's shared address is not a register: "
                            f"{m.group(0).strip()}")
        dsts.append(dst.group(1))
    ours = set(dsts)
    parent = {x.group(1): x.group(2) for x in _ADD_IMM.finditer(text) if x.group(2) in ours}
    roots = set()
    for reg in dsts:
        seen = set()
        while reg in parent and reg not in seen:
            seen.add(reg)
            reg = parent[reg]
        roots.add(reg)
    for r in sorted(roots):
        line = "\t" + _OPAQUE.format(r) + "\n"
        defs = [d for d in re.finditer(rf"^[ \t]*(?:@!?%p\d+[ \t]+)?[a-z][\w.:]*[ \t]+"
                                       rf"{re.escape(r)},[^\n]*\n", text, re.M)
                if "glm_dsa: opaque address" not in d.group(0)]
        if not defs:
            raise HintError(f"{name}: no definition of {r}, the root of hinted cp.async "
                            "addresses, to make opaque")
        for d in reversed(defs):
            if not text.startswith(line, d.end()):  # made opaque by an earlier pass
                text = text[:d.end()] + line + text[d.end():]
    return text


def rewrite_ptx(ptx: str, entries: Iterable[str]) -> str:
    """``ptx`` with the masked ``cp.async`` of each ``.entry`` named in ``entries`` that carries a
    marker hinted as the marker says (the module docstring); every other entry, and every line
    that is not such a copy, unchanged. Raises ``HintError`` for a marked entry with nothing to
    hint (or two markers, or copies hinted otherwise)."""
    names = set(entries)
    parts, pos = [], 0
    for name, start, end in _entries(ptx):
        if name in names:
            parts += [ptx[pos:start], _rewrite_entry(name, ptx[start:end])]
            pos = end
    return "".join(parts) + ptx[pos:] if parts else ptx


def hinted_copies(ptx: str) -> dict[str, int]:
    """How many ``cp.async`` carry each qualifier string (``""``: none), masked or not; for
    checking a compiled kernel's PTX."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"^[ \t]*cp\.async\.(?:ca|cg)\.shared\.global((?:\.L2::\w+)*)[ \t]", ptx,
                         re.M):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


_SASS_INS = re.compile(r"/\*[0-9a-f]{4,}\*/[ \t]+([^;\n]*);")
_SASS_DEF = re.compile(r"^(?:@!?U?P\w+[ \t]+)?(?P<op>[A-Z][A-Z0-9_.]*)[ \t]+UR(?P<n>\d+)\b")


def undefined_uniform_reads(sass: str) -> list[str]:
    """The ``LDGSTS`` of ``sass`` (nvdisasm's text of one binary) that read a uniform register no
    instruction writes: ptxas's miscompile of hinted copies (the module docstring), which traps
    at run time as an illegal instruction. Empty for a sound binary."""
    ins = _SASS_INS.findall(sass)
    written = set()
    for i in ins:
        d = _SASS_DEF.match(i.strip())
        if d and not d["op"].startswith(("LDGSTS", "ST", "RED", "ATOM", "SYNCS", "ARRIVES")):
            n = int(d["n"])
            written.update({n, n + 1} if ".64" in d["op"] else {n})
    return [i.strip() for i in ins if "LDGSTS" in i and not i.strip().startswith("ARRIVES")
            and any(int(n) not in written for n in re.findall(r"\bUR(\d+)\b", i))]


_ENTRY_NAMES: set[str] = set()


def install(entries: Iterable[str]) -> None:
    """From now on, run ``rewrite_ptx`` on the PTX of every Triton compile in this process for
    the kernels named ``entries`` (the union over calls). Idempotent; it stays installed,
    because Triton may compile later than the call that asked (lazily, or in a compile
    thread) and a hinted kernel compiled without it would be cached unhinted. A hook
    installed before keeps running, first. Entries without a marker pass through unchanged.
    Triton 3.6's hook protocol only (later versions also call it without arguments, for a
    cache key)."""
    import triton
    from triton import knobs

    if triton.__version__.split(".")[:2] != ["3", "6"]:
        raise RuntimeError(f"the gather hint's PTX pass hooks Triton 3.6's stages, not "
                           f"{triton.__version__}'s")
    _ENTRY_NAMES.update(entries)
    prev = knobs.runtime.add_stages_inspection_hook
    if getattr(prev, "_glm_dsa_gather_hint", False):
        return

    def hook(backend, stages, options, language, capability):
        if prev is not None:
            prev(backend, stages, options, language, capability)
        make_ptx = stages.get("ptx")
        if make_ptx is not None:
            stages["ptx"] = lambda src, metadata: rewrite_ptx(make_ptx(src, metadata),
                                                              _ENTRY_NAMES)

    hook._glm_dsa_gather_hint = True  # type: ignore[attr-defined]
    knobs.runtime.add_stages_inspection_hook = hook
