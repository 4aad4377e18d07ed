#!/usr/bin/env bash
# Run the tests N times (optionally with a busy core) and report which failed how often.
# Usage: scripts/flake_check.sh [-n N] [--busy-core CPU] [--timeout S] [--out DIR] [pytest args ...] [-- pytest args ...]
# See scripts/flake_check.py for the details.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python}" "$here/flake_check.py" "$@"
