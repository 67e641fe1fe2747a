"""The context n-gram draft on the device: unfold-and-compare over each row's recent tokens.

Each row's last `window` tokens (left-padded with -1) are compared, at every earlier position,
with the row's last n tokens, for n from `max_n` down to 1; the longest n that occurs earlier
wins, and its most recent earlier occurrence gives the draft: the up-to-w tokens that followed
it. One draft a row, all rows at once, in fixed-size tensor operations (vLLM's GPU n-gram
proposer works the same way). The host strategy (`drafting.ContextNgram`) ranks several
continuations by count through an index; a device round drafts the one.
"""

from __future__ import annotations

import torch

MAX_N = 4
WINDOW = 512  # recent tokens a row is matched in: bounds the work at any context length


def context_drafts(
    recent: torch.Tensor, w: int, max_n: int = MAX_N
) -> tuple[torch.Tensor, torch.Tensor]:
    """`recent` [R, L] int64 (the rows' last L tokens, -1 before a row's first): the drafts
    [R, w] and which of their tokens exist [R, w] (a prefix of each row).

    Every earlier position e is scored by how many tokens ending there equal the row's last
    ones (up to `max_n`, in one comparison of [R, L, max_n] windows), the longest and then the
    latest taken: what trying n = max_n, ..., 1 in turn finds, in a dozen operators whatever n."""
    rows, length = recent.shape
    device = recent.device
    if length < 2:  # nothing before the last token
        return torch.zeros(rows, w, dtype=torch.long, device=device), torch.zeros(
            rows, w, dtype=torch.bool, device=device
        )
    padded = torch.nn.functional.pad(recent, (max_n - 1, 0), value=-1)  # [R, L + max_n - 1]
    # [R, L - 1, max_n]: the tokens ending at each earlier position
    windows = padded.unfold(1, max_n, 1)[:, :-1]
    suffix = padded[:, -max_n:]  # [R, max_n]
    equal = (windows == suffix[:, None, :]) & (windows >= 0)
    # [R, L - 1]: tokens matched, backwards from each end
    matched = equal.flip(-1).cumprod(-1).sum(-1)
    ends = torch.arange(length - 1, device=device)
    best = (matched * length + ends).amax(-1)  # the longest match, then the latest end
    longest, end = best // length, best % length
    offsets = end[:, None] + 1 + torch.arange(w, device=device)  # [R, w]: the tokens after it
    valid = (longest[:, None] > 0) & (offsets < length)
    drafts = recent.gather(1, offsets.clamp(max=length - 1))
    return torch.where(valid, drafts, 0), valid
