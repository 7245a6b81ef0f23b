"""`imgcls` with a run directory of its own per rank: `<base>/rank<RANK>`, as on nodes that share no disk.

    torchrun --nproc-per-node 2 -m tests.per_rank_run_dir <base> predict --config ...
"""

from __future__ import annotations

import os
import sys

from imgcls.commands import main as cli_main


def main() -> None:
    base, *args = sys.argv[1:]
    cli_main([*args, "--trainer.default_root_dir", os.path.join(base, f"rank{os.environ['RANK']}")])


if __name__ == "__main__":
    main()
