"""`smsplit._args.check_int`: the one rule for integer arguments (EP buffer, node layouts, the router, the copy
plans), each caller's error type and phrasing kept."""

import numpy as np
import pytest

from smsplit import _args, nodes
from smsplit.ep import checks
from smsplit.ep.transport import EPArgumentError
from smsplit.moe import router


def test_ints_in_range_come_back_as_python_ints():
    for value, want in ((3, 3), (np.int64(3), 3), (np.int32(0), 0), (np.uint8(4), 4)):
        got = _args.check_int("n", value, 0, stop=5)
        assert got == want and type(got) is int
    assert _args.check_int("n", 65536, 1, 65536) == 65536
    assert _args.check_int("n", _args.MAX_INT, 0) == _args.MAX_INT


@pytest.mark.parametrize("value,kwargs,message", [
    (0, dict(minimum=1), "n must be an int >= 1, got 0"),
    (True, dict(minimum=0), "n must be an int >= 0, got True"),
    (2.0, dict(minimum=1), "n must be an int >= 1, got 2.0"),
    ("3", dict(minimum=1), "n must be an int >= 1, got '3'"),
    (None, dict(minimum=1), "n must be an int >= 1, got None"),
    (np.float64(3), dict(minimum=1), "n must be an int >= 1, got"),
    (4, dict(minimum=0, stop=4), "n must be an int in [0, 4), got 4"),
    (-1, dict(minimum=0, stop=4), "n must be an int in [0, 4), got -1"),
    (65537, dict(minimum=1, maximum=65536), "n must be an int in [1, 65536], got 65537"),
    (2 ** 70, dict(minimum=0), f"n must be an int <= {(1 << 62) - 1}, got {2 ** 70}"),
])
def test_anything_else_is_refused_naming_the_argument(value, kwargs, message):
    with pytest.raises(ValueError) as caught:
        _args.check_int("n", value, **kwargs)
    assert str(caught.value).startswith(message) and type(caught.value) is ValueError, caught.value


def test_each_caller_keeps_its_error_type_and_phrasing():
    with pytest.raises(EPArgumentError) as caught:
        checks.check_int("num_experts", 0, 1)
    assert caught.value.argument == "num_experts" and str(caught.value) == "num_experts: expected an int >= 1, got 0"
    with pytest.raises(EPArgumentError, match=r"^config: config.num_sms must be an int in \[1, 65536\], got 'many'"):
        checks.sms_count("config", "many", "config.num_sms must be")
    with pytest.raises(EPArgumentError, match=r"^num_worst_tokens: expected an int in \[0, 2147483647\], got -1"):
        checks.check_int("num_worst_tokens", -1, 0, checks.MAX_ROWS)
    with pytest.raises(ValueError, match=r"^rank must be an int in \[0, 4\), got "):
        nodes.NodeLayout(2, 2).node_of(np.int64(4))
    assert nodes.NodeLayout(2, 2).node_of(np.int64(3)) == 1
    with pytest.raises(ValueError, match="^topk must be an int >= 1, got 0") as caught:
        router.Router(8, 4, 0)
    assert not isinstance(caught.value, EPArgumentError)
