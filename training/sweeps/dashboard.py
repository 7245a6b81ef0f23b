"""A sweep's dashboard: optuna-dashboard on the sweep's storage (its trials, each epoch's metric, parameter
importances), on 127.0.0.1.

    make sweep-dashboard STORAGE=sqlite:///runs/sweeps/quickstart_lr/sweep.db
    python -m training.sweeps.dashboard [--storage URL] [--port 8080]     # URL default: $IMGCLS_SWEEP_STORAGE

The storage is opened as `imgcls sweep` opens it (a database URL, or journal:///<path>), and a URL read from
$IMGCLS_SWEEP_STORAGE keeps its password off the command line, where `ps` would show it.
"""

from __future__ import annotations

import argparse
import os
import sys

from training.records.secrets import redact_secrets
from training.sweeps.trial import STORAGE_ENV_VAR, open_storage


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.sweeps.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default=os.environ.get(STORAGE_ENV_VAR),
                        help=f"the sweep's storage, as `imgcls sweep --storage` takes it (default ${STORAGE_ENV_VAR})")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (another machine: an SSH tunnel)")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if not args.storage:
        raise SystemExit("error: no storage: pass --storage URL (e.g. sqlite:///runs/sweeps/<name>/sweep.db) or set "
                         f"{STORAGE_ENV_VAR}")
    from optuna_dashboard import run_server

    print(f"sweep dashboard of {redact_secrets(args.storage)} on http://{args.host}:{args.port}/", flush=True)
    run_server(open_storage(args.storage), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
