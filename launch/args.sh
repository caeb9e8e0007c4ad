# Sourced by the launch scripts. split_words NAME: the words of the environment variable NAME as
# a shell reads them (single and double quotes, backslashes; nothing expanded) into the array
# WORDS, so that DS_ARGS='--launcher_args "-x A=1 -x B=2"' passes one argument after the flag;
# an unmatched quote ends the script naming NAME.
split_words() {
    WORDS=()
    local text=${!1:-} words
    [[ -n $text ]] || return 0
    # Python's shlex reads as a POSIX shell does (xargs does not: a backslash inside double quotes
    # was its own, and a newline inside quotes an error)
    words=$(python3 -c 'import shlex, sys
try:
    print("".join(w + "\037" for w in shlex.split(sys.argv[1])), end="")
except ValueError:  # no closing quotation, or a backslash at the end
    sys.exit(1)' "$text") || { echo "error: $1: an unmatched quote in: $text" >&2; exit 2; }
    IFS=$'\037' read -r -d '' -a WORDS < <(printf '%s' "$words") || true
}
