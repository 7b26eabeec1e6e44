"""Region specs by key: what a compiled graph's ``tracedac_region`` annotation refers to
(``vocab.SPECS``, filled here).

A key is ``"<region name>|<policy>"``, the policy as written (``save_matmuls()``) or, for a
callable, its qualified name and a hash of its code, so equal keys in two processes mean the
same thing (the key travels in the graph; the pass's ``uuid`` covers every key known, which
keeps inductor's cache from mixing policies). Two different policies that print the same
get distinct keys (``#2``, ...).
"""

from __future__ import annotations

import hashlib

from .vocab import SPECS

__all__ = ["SPECS", "describe", "install_traced", "key_for"]

_NAMED: dict[int, object] = {}  # every policy a compiled region named (``key_for``), by id


def describe(policy) -> str:
    from ..policies.held import describe_policy

    text = describe_policy(policy)
    code = getattr(getattr(policy, "__call__", None), "__code__", None) or getattr(policy, "__code__", None)
    if code is not None and not type(policy).__module__.startswith("tracedac."):
        text += "@" + hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:12]
    return text


def key_for(policy, name: str) -> str:
    """The key of ``policy`` (a function, or the id of any other policy: ``decisions.HELD``)
    and region ``name``, registered on first use. Dynamo calls this at trace time and takes
    the result as a constant (``_dynamo_marked_constant``): no guard, no graph op. By id,
    because dynamo hands such a function strings, numbers and functions but not every object:
    torch 2.11 refuses any frozen dataclass (a policy), and 2.13 one made inside the compiled
    code (``save_matmuls()`` made there lost its field)."""
    if isinstance(policy, int):
        from ..policies.held import held

        live = held(policy)
        if live is None:
            from .._compat import trace_time_error

            raise trace_time_error(
                f"region {name!r} is compiled with a policy made inside the compiled code, which "
                "dynamo cannot hand to tracedac. Make the policy outside it (policy = tracedac."
                "policies.save_matmuls() once, then pass policy=policy), or checkpoint the function "
                "or module outside the compiled code."
            )
        policy = live
    base = f"{name}|{describe(policy)}"
    key, n = base, 1
    while key in SPECS and SPECS[key][0] is not policy and SPECS[key][0] != policy:
        n += 1
        key = f"{base}#{n}"
    SPECS[key] = (policy, name)
    # Held for the process once a compiled region names it: dynamo guards the region's code on
    # ``id(policy)``, and a policy that died could leave its id to a different one, which would
    # pass that guard and be served this policy's graph.
    _NAMED[id(policy)] = policy
    return key


key_for._dynamo_marked_constant = True  # torch._dynamo.assume_constant_result, without importing dynamo


def install_traced() -> bool:
    """``install.install()`` from traced code (a region's entry, a sharded unit's forward):
    dynamo calls it at trace time and takes the result as a constant (no guard, no graph op).
    Here, not in ``install.py``, so importing tracedac imports no inductor module (the one
    import of a compile/ module made inside a function, for that reason)."""
    from .install import install

    install()
    return True


install_traced._dynamo_marked_constant = True
