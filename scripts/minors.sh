# Sourced by scripts/test_compat.sh and scripts/test_tf.sh. `pick_minors "MINORS..."` prints
# those DISTRIB_TF_MINORS asks for: oldest (the oldest declared, the furthest from .venv's,
# which make test runs: what .ci/run tests), others (the rest: make soak), all (the default).
pick_minors() {
  local oldest=${1%% *}
  case "${DISTRIB_TF_MINORS:-all}" in
    oldest) echo "$oldest" ;;
    others) echo ${1#"$oldest"} ;;  # Unquoted: the words, without the leading space.
    all) echo "$1" ;;
    *) echo "$(basename "$0"): DISTRIB_TF_MINORS is '$DISTRIB_TF_MINORS'; expected oldest, others or all" >&2
       return 2 ;;
  esac
}
