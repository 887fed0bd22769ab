# Shared helpers for the launchers in this folder (sourced, not executed).
#
# `run CMD...` prints CMD (shell-quoted, one line, prefixed "+ ") under --dry-run and executes it
# otherwise; `run_bg` does the same but starts CMD in the background and records its pid.

DRY_RUN=${DRY_RUN:-0}
BG_PIDS=()

parse_common_args() {
  for arg in "$@"; do
    case "$arg" in
      --dry-run) DRY_RUN=1 ;;
      -h|--help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
      *) echo "unknown argument: $arg (use --dry-run or --help)" >&2; exit 2 ;;
    esac
  done
}

quote_word() {  # as is when safe, else in single quotes (readable, and valid shell)
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then printf '%s' "$1"
  else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

quote_cmd() {
  local out="" word
  for word in "$@"; do out+="$(quote_word "$word") "; done
  printf '%s\n' "${out% }"
}

run() {
  if [[ "$DRY_RUN" == 1 ]]; then echo "+ $(quote_cmd "$@")"; else "$@"; fi
}

run_bg() {
  if [[ "$DRY_RUN" == 1 ]]; then echo "+ $(quote_cmd "$@") &"; return; fi
  "$@" &
  BG_PIDS+=("$!")
}

require_vars() {
  local name missing=()
  for name in "$@"; do [[ -n "${!name:-}" ]] || missing+=("$name"); done
  if (( ${#missing[@]} )); then
    echo "set these variables first: ${missing[*]} (see --help)" >&2
    exit 2
  fi
}
