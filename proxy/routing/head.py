"""Deciding on a prompt's head: when the rest of the prompt may change the choice.

A long prompt whose history is tokenized already is decided on that head while its
rest is tokenized (``Router.decide(n_prompt=...)``). The choice stands unless
`rest_may_change` says the rest may show a better holder: the request then waits for
its whole prompt (`NeedWholePrompt`). (A checkpointed backend's slots tell nothing on a
head: there the router asks for the whole prompt before choosing, see
``Router._candidates``.)
"""

from __future__ import annotations

from proxy.routing.options import RELATED_TOKENS
from proxy.routing.tree.node import Holder
from proxy.routing.tree.radix import RadixTree

# tokens past a head compared to tell whether its holders go on alike
_AHEAD = 16


def rest_may_change(tree: RadixTree, held: dict[Holder, int], n_head: int,
                    reuse: int) -> bool:
    """May the rest of a prompt decided on its ``n_head``-token head show a holder it
    goes on from further than the choice, reusing ``reuse``? Then the choice waits for
    the whole prompt: a request is not moved off its history on its head's word.

    It may when a holder has more of the head than the choice reuses (the rest may go
    on from it: a summary whose tool result its turn just put in the slot), and when
    holders of the whole head go on from it differently (conversations over one system
    prompt, the head being that prompt): the choice took one of them at most, and only
    the rest tells which it goes on from. Holders of fewer than RELATED_TOKENS share a
    template's opening of the head (hundreds of tokens), no more: the rest cannot match
    them further, and the policy takes an empty slot over them, as on the whole prompt.
    (A slot and its copy in RAM go on alike.)"""
    most = most_held(held)
    if most >= RELATED_TOKENS and reuse < most:
        return True
    nexts = {tree.tokens_of(h)[4 * n_head:4 * (n_head + _AHEAD)]
             for h, got in held.items() if got >= n_head}
    return len(nexts) >= 2


def most_held(held: dict[Holder, int]) -> int:
    """The most tokens of a prompt any holder of KV has (every holder of the tree is)."""
    return max(held.values(), default=0)
