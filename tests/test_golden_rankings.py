"""A change to how the model is organised must not change what it predicts: every stored candidate of
tests/data/golden_rankings.csv (every preset x profile) is re-ranked and compared within 1e-9."""
import numpy as np
import pandas as pd

from tests.golden_rankings import GOLDEN, KEY, VALUES, compute


def test_rankings_match_the_golden_file():
    want = pd.read_csv(GOLDEN)
    got = compute()
    assert len(got) == len(want) > 300
    both = want.merge(got, on=KEY + ["gpus", "global_batch"], suffixes=("_want", "_got"), how="left",
                      validate="one_to_one")
    for v in VALUES:
        a, b = both[f"{v}_want"].to_numpy(), both[f"{v}_got"].to_numpy()
        if v == "feasible":
            assert (a == b).all(), both.loc[a != b, KEY]
        else:
            bad = ~np.isclose(b, a, rtol=1e-9, atol=0.0, equal_nan=True)  # NaN: not timed
            assert not bad.any(), both.loc[bad, KEY + [f"{v}_want", f"{v}_got"]].head()
