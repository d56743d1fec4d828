"""``python -m benchmarks.kda_tune --set``: a launch option changes only the named entry; bad input names
the valid choices."""
import copy
import re

import pytest


@pytest.fixture(scope="module")
def tune():
    from benchmarks import kda_tune

    return kda_tune


def test_set_changes_only_the_named_option(tune):
    from kernels.kda.triton_fwd import LAUNCH

    table = copy.deepcopy(LAUNCH)
    tune.set_option(table, "bwd_state.num_warps=4")
    tune.set_option(table, "output.num_stages=3")        # a Triton option the table does not list yet
    expected = copy.deepcopy(LAUNCH)
    expected["bwd_state"]["num_warps"] = 4
    expected["output"]["num_stages"] = 3
    assert table == expected


@pytest.mark.parametrize("item, message", [
    ("nosuch.BV=16", "unknown kernel 'nosuch' in --set; valid: intra, wy"),
    ("output.BKX=16", "unknown option 'BKX' of output in --set; valid: BV, num_stages, num_warps"),
    ("output.BV=wide", "the value must be an integer"),
    ("output=16", "--set takes KERNEL.OPTION=VALUE"),
])
def test_set_rejects_bad_input_with_the_valid_choices(tune, item, message):
    from kernels.kda.triton_fwd import LAUNCH

    table = copy.deepcopy(LAUNCH)
    with pytest.raises(ValueError, match=re.escape(message)):
        tune.set_option(table, item)
    assert table == LAUNCH
