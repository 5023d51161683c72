"""What a start-up does not import: a CLI command and a worker start from bytecode, and
every module loaded before the first task is start-up time (bench.drain counts it)."""

from __future__ import annotations

import subprocess
import sys


def test_jsonschema_is_imported_only_when_a_schema_is_checked() -> None:
    code = (
        "import sys\n"
        "import runtime.cli.app, runtime.wiring, runtime.engine.worker\n"
        "import policies.builtin, policies.criteria, agents.tools, runtime.llm.reply\n"
        "import runtime.engine.judge_stage, runtime.store.steering.types\n"
        "print('jsonschema' in sys.modules)\n"
        "from policies.builtin import schema_validator\n"
        "assert list(schema_validator({'type': 'object'}).iter_errors([1]))\n"
        "print('jsonschema' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]
