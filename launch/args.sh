# Sourced by the launch scripts. split_words NAME: the words of the environment variable NAME as
# a shell reads them (single and double quotes, backslashes; nothing expanded) into the array
# WORDS, so that DS_ARGS='--launcher_args "-x A=1 -x B=2"' passes one argument after the flag;
# an unmatched quote ends the script naming NAME.
split_words() {
    WORDS=()
    local text=${!1:-} words
    [[ -n $text ]] || return 0
    words=$(xargs -r printf '%s\037' <<< "$text") \
        || { echo "error: $1: an unmatched quote in: $text" >&2; exit 2; }
    IFS=$'\037' read -r -d '' -a WORDS < <(printf '%s' "$words") || true
}
