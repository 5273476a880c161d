"""Stop strings on the text side: matches across token boundaries, and streaming hold-back.

Only the tail that can contain a new match is searched each step (the new text plus
max stop length - 1 characters before it), so a long output costs O(new text) per step.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stop), default=0)

    def __bool__(self) -> bool:
        return bool(self.stop)

    def find(self, text: str, num_new_chars: int) -> tuple[str, int] | None:
        """Look for a stop string that ends in the last `num_new_chars` characters of `text`.

        Returns (stop string, length to truncate the text to) for the earliest match, or None.
        The truncation keeps the stop string when include_stop_str_in_output is set.
        """
        if not self.stop or num_new_chars <= 0:
            return None
        start = max(0, len(text) - num_new_chars - self.max_len + 1)
        best: tuple[str, int] | None = None
        best_pos = len(text) + 1
        for s in self.stop:
            pos = text.find(s, start)
            if pos != -1 and pos < best_pos:
                best, best_pos = s, pos
        if best is None:
            return None
        return best, best_pos + (len(best) if self.include else 0)

    def hold_back(self, text: str) -> int:
        """Number of trailing characters of `text` that could still be the start of a stop
        string; a streaming client must not see them yet.

        Only the last len(s) - 1 characters can start a proper prefix of s, and a candidate start
        must be an occurrence of s's first character: both searches run in C, so a call costs
        O(len(s)) for ordinary text and at most O(len(s)^2) character compares for a periodic
        one (MAX_STOP_CHARS bounds it)."""
        longest = 0
        for s in self.stop:
            m = len(s) - 1  # proper prefixes only: a full match would already have stopped it
            if m <= longest:
                continue
            tail = text[-m:]
            i = tail.find(s[0])
            while i != -1 and len(tail) - i > longest:
                if s.startswith(tail[i:]):
                    longest = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return longest
