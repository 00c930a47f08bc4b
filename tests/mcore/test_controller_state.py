"""The controller's checkpoint state refuses statistics saved for other layers, with a message
that names the differing layers and what may have changed (streaming fragments cut layers)."""

import pytest

from megatron_edit.algorithm.penalty import EWMAStats
from megatron_edit.mcore.controller_state import ControllerState


def test_statistics_saved_for_other_layers_are_refused_naming_them():
    state = ControllerState()
    state.layer_names = ["decoder.layers.0", "decoder.layers.1@fragment0", "decoder.layers.1@fragment1"]
    saved = {"layer_names": ["decoder.layers.0", "decoder.layers.1"],
             "ewma": EWMAStats.zeros(2, 2).state_dict()}
    with pytest.raises(ValueError) as info:
        state.load_extra_state(saved)
    message = str(info.value)
    assert "2 saved, 3 now" in message and "'decoder.layers.1'" in message
    assert "'decoder.layers.1@fragment0'" in message and "--local-sgd-fragments" in message
