"""describe_host: the machine fields every benchmark record carries."""

from __future__ import annotations

import os
import platform

from k3serve.host import describe_host


def test_the_record_names_this_machine():
    host = describe_host()
    assert host["cores"] == os.cpu_count()
    assert host["python"] == platform.python_version()
    assert isinstance(host["cpu"], str) and host["cpu"]
    assert host["load_average"] >= 0
