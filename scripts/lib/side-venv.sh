# A virtual environment of its own for a component whose pins must not touch the product's (sourced).
#
# The caller sets NAME (its log prefix), VENV, PYTHON, PYTHON_HINT (how to name another
# interpreter, for the error), STAMP and WANT (what a finished install of this version records), then:
#   side_venv_begin   returns at once (exit 0) when the stamp says WANT is installed; otherwise takes
#                     the lock (one install at a time: `make test` and a test fixture may both get
#                     here), creates the venv if it is missing or broken, and clears the stamp;
#   side_venv_pip     pip in the venv, without the warnings about index locations this machine lists
#                     but lacks;
#   side_venv_done    records the stamp and says how long the install took.

say() { echo "$NAME: $*" >&2; }

side_venv_pip() {
  "$VENV/bin/python" -m pip "$@" 2>&1 | sed '/is ignored: it is neither a file nor a directory/d' >&2
}

_side_venv_ready() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]
}

side_venv_begin() {
  if _side_venv_ready; then
    say "ready at $VENV"
    exit 0
  fi
  mkdir -p "$(dirname "$VENV")"
  exec 9>"$VENV.lock"
  flock 9
  if _side_venv_ready; then
    say "ready at $VENV, installed by a concurrent run"
    exit 0
  fi
  SIDE_VENV_STARTED=$(date +%s)
  if ! command -v "$PYTHON" >/dev/null; then
    say "$PYTHON not found; set $PYTHON_HINT"
    exit 1
  fi
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import sys" 2>/dev/null; then
    say "creating virtual environment $VENV with $("$PYTHON" --version 2>&1)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  rm -f "$STAMP"
}

side_venv_done() {
  echo "$WANT" > "$STAMP"
  say "ready at $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1), $(( $(date +%s) - SIDE_VENV_STARTED )) s)"
}
