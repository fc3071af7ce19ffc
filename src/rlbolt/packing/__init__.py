"""Padding-free packed batches: several samples per row, so tokens, not rows, set the cost.

`layout` places samples into rows on the host (first-fit decreasing) and writes the three batch
columns that carry the placement; `forward` runs the log-prob forward over the packed rows and
returns the same [N, C] arrays as the padded forward; `logps` wraps the jitted log-prob forwards.
"""

from rlbolt.packing.forward import packed_sequence_logps
from rlbolt.packing.layout import (PACKING_MODES, PackingError, PackingSpec, bucket_rows, first_fit_decreasing,
                                   pack_columns, pack_sources, packing_spec, sample_lengths, source_slots,
                                   with_pack_columns)

PACK_COLUMNS = ("pack_rows", "pack_starts", "pack_sources")

__all__ = ["PACKING_MODES", "PACK_COLUMNS", "PackingError", "PackingSpec", "bucket_rows", "first_fit_decreasing",
           "pack_columns", "pack_sources", "packed_sequence_logps", "packing_spec", "sample_lengths",
           "source_slots", "with_pack_columns"]
