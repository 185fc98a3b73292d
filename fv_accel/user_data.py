"""A recipe's built-in tiny validation set follows the data the user trains on.

The tiny recipes score the held-out loss on new tiny clips (`callbacks.validation.heldout_data_path:
tiny`) and sample prompts that describe tiny clips. With `training.data.data_path` pointing at other
data, both would measure something unrelated to that data. Instead, with a warning that says what
was done and which key changes it:

- held-out loss: `heldout_max_samples` rows of the training data, at most a tenth of it, are held
  out (as `heldout_fraction` would; drawn from the data seed). This happens whether validation is
  on or off, so that switching validation never changes what the model trains on. Under 10 rows,
  none are held out and there is no held-out loss.
- sample prompts (validation on): each prompt that is a built-in tiny caption is replaced by a
  caption of the data, the held-out rows' first.
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

# At most this share of a user's rows is held out in place of the built-in tiny clips.
HELDOUT_SHARE = 0.1


def tiny_caption_pattern() -> re.Pattern:
    """The captions the tiny world's clips carry (`fv_accel.tiny.clips.ClipSpec.caption`)."""
    from fv_accel.tiny import tiny_caption_words

    words = tiny_caption_words()

    def alt(name: str) -> str:
        return "(?:" + "|".join(re.escape(w) for w in words[name]) + ")"

    return re.compile(
        rf"a {alt('colors')} {alt('shapes')} moving {alt('motions')} on a {alt('backgrounds')} background", re.IGNORECASE
    )


def _captions(data_path: str, rows: list[int]) -> list[str]:
    """Captions of the given rows (in that order) of a Parquet dataset, read column-wise."""
    import pyarrow.parquet as pq

    from fv_accel.data.schema import parquet_files

    wanted = set(rows)
    found: dict[int, str] = {}
    start = 0
    for f in parquet_files(data_path):
        meta = pq.ParquetFile(f)
        n = meta.metadata.num_rows
        if any(start <= r < start + n for r in wanted) and "caption" in meta.schema_arrow.names:
            column = pq.read_table(f, columns=["caption"]).column("caption").to_pylist()
            found.update({r: column[r - start] for r in wanted if start <= r < start + n})
        start += n
        if len(found) == len(wanted):
            break
    return [found[r] for r in rows if isinstance(found.get(r), str) and found[r].strip()]


def follow_user_data(cfg: Any, data_path: str, *, log: bool = True) -> None:
    """Adapt `cfg.callbacks.validation` (in place) when the recipe's tiny validation set does not
    belong to the training data; see the module docstring."""
    from fv_accel.validation import count_rows, heldout_split

    if cfg.training.data.data_path == "tiny":
        return
    val = cfg.callbacks.validation
    warn = logger.warning if log else (lambda *a, **k: None)
    heldout_rows: list[int] = []
    rows = None
    if val.heldout_data_path == "tiny":
        rows = count_rows(data_path)
        count = min(val.heldout_max_samples, int(rows * HELDOUT_SHARE))
        val.heldout_data_path = None
        if count < 1:
            val.heldout_fraction = 0.0
            (warn if val.enable else logger.debug)(
                "callbacks.validation.heldout_data_path is 'tiny' (the built-in clips) but the training data is "
                "%s: no held-out loss (its %d row(s) are too few to hold a tenth out); set "
                "callbacks.validation.heldout_data_path to a held-out dataset of yours",
                data_path,
                rows,
            )
        else:
            val.heldout_fraction = count / rows
            heldout_rows = heldout_split(rows, val.heldout_fraction, cfg.training.data.seed)
            warn(
                "callbacks.validation.heldout_data_path is 'tiny' (the built-in clips) but the training data is "
                "%s: the held-out loss uses %d of its %d rows instead, never trained on "
                "(callbacks.validation.heldout_fraction %.4g); set callbacks.validation.heldout_data_path to a "
                "dataset (or null) to choose otherwise",
                data_path,
                len(heldout_rows),
                rows,
                val.heldout_fraction,
            )
    if not val.enable or not val.prompts:
        return
    pattern = tiny_caption_pattern()

    def text_of(entry: Any) -> Any:
        return entry.get("prompt") if isinstance(entry, dict) else entry

    tiny = [i for i, e in enumerate(val.prompts) if isinstance(text_of(e), str) and pattern.fullmatch(text_of(e).strip())]
    if not tiny:
        return
    rows = count_rows(data_path) if rows is None else rows
    order = heldout_rows + [r for r in range(min(rows, 64 + len(heldout_rows))) if r not in set(heldout_rows)]
    captions = list(dict.fromkeys(c.strip() for c in _captions(data_path, order)))[: len(tiny)]
    old = [text_of(val.prompts[i]) for i in tiny]
    prompts = list(val.prompts)
    for i, caption in zip(tiny, captions):
        prompts[i] = {**prompts[i], "prompt": caption} if isinstance(prompts[i], dict) else caption
    dropped = set(tiny[len(captions):])
    val.prompts = [p for i, p in enumerate(prompts) if i not in dropped]
    warn(
        "callbacks.validation.prompts %s describe the built-in tiny clips but the training data is %s: "
        "sampling with %s instead%s; set callbacks.validation.prompts (or prompt_file) to choose",
        old,
        data_path,
        captions if captions else "no prompt",
        f" ({len(dropped)} prompt(s) dropped: the data has no more distinct captions)" if dropped else "",
    )
