# Sourced by the A/B scripts (served_ab.sh, speed_ab.sh): check out REV into a git worktree at $WORK/old, removed on
# exit, and set OLD_PYTHONPATH so that a Python started there imports REV's package. REV runs from the worktree as
# its own current directory, with this venv and the editable install's import hook removed: `python -m dflash_trt`
# imports the package from the current directory first, and the editable hook maps it back to this checkout, so
# PYTHONPATH alone benchmarks the new code twice (session 18 found its own first A/B, and possibly session 17's,
# doing that). Needs ROOT (this checkout) and REV.
WORK=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$WORK/old" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git -C "$ROOT" worktree add --detach "$WORK/old" "$REV" >/dev/null
mkdir -p "$WORK/site"
cat > "$WORK/site/sitecustomize.py" <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")) + repr(f)]
PY
OLD_PYTHONPATH="$WORK/site:$WORK/old"
imported=$(cd "$WORK/old" && PYTHONPATH="$OLD_PYTHONPATH" "$ROOT/.venv/bin/python" -c \
  'import dflash_trt; print(dflash_trt.__file__)')
[[ "$imported" == "$WORK/old/"* ]] || { echo "REV's package did not import ($imported)" >&2; exit 1; }
