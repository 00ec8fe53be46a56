#!/usr/bin/env bash
# A tmux session laid out to follow an rl run: a command pane (run `uv run rl ...` there) and one pane per log.
#   bash scripts/tmux.sh [-s SESSION] [-o OUTPUT_DIR] [-d]   (-d: create it detached, do not attach)
# Re-running it attaches to the session if it exists.
set -euo pipefail

SESSION=prime
OUTPUT_DIR=outputs
DETACHED=0
usage() { echo "usage: $0 [-s session-name] [-o output-dir] [-d]" >&2; exit "${1:-2}"; }
while getopts "s:o:dh" opt; do
    case $opt in
        s) SESSION=$OPTARG ;;
        o) OUTPUT_DIR=$OPTARG ;;
        d) DETACHED=1 ;;
        h) usage 0 ;;
        *) usage ;;
    esac
done
command -v tmux > /dev/null || { echo "tmux is not installed" >&2; exit 1; }

attach() {
    (( DETACHED )) && return 0
    if [[ -n "${TMUX:-}" ]]; then tmux switch-client -t "$SESSION"; else tmux attach-session -t "$SESSION"; fi
}
if tmux has-session -t "=$SESSION" 2> /dev/null; then
    attach
    exit 0
fi

LOG_DIR="$OUTPUT_DIR/logs"
mkdir -p "$LOG_DIR"
follow() {  # wait for the log to appear, then follow it across restarts (tail -F)
    echo "while [ ! -f '$LOG_DIR/$1.log' ]; do sleep 1; done; tail -n +1 -F '$LOG_DIR/$1.log'"
}

# Layout: left column = Trainer (command pane, top) over the trainer log; right column = Orchestrator over Inference.
CMD_PANE=$(tmux new-session -d -s "$SESSION" -n rl -c "$PWD" -P -F '#{pane_id}')
tmux set-option -t "$SESSION" pane-border-status top > /dev/null
tmux set-option -t "$SESSION" pane-border-format " #{pane_title} " > /dev/null
tmux set-option -t "$SESSION" allow-rename off > /dev/null
ORCH_PANE=$(tmux split-window -h -t "$CMD_PANE" -c "$PWD" -P -F '#{pane_id}' "$(follow orchestrator)")
INFER_PANE=$(tmux split-window -v -t "$ORCH_PANE" -c "$PWD" -P -F '#{pane_id}' "$(follow inference)")
TRAIN_PANE=$(tmux split-window -v -t "$CMD_PANE" -c "$PWD" -P -F '#{pane_id}' "$(follow trainer)")
tmux select-pane -t "$CMD_PANE" -T "Trainer (commands)"
tmux select-pane -t "$TRAIN_PANE" -T "Trainer log"
tmux select-pane -t "$ORCH_PANE" -T "Orchestrator"
tmux select-pane -t "$INFER_PANE" -T "Inference"
tmux select-pane -t "$CMD_PANE"
tmux send-keys -t "$CMD_PANE" "# uv run rl @ examples/reverse_text/rl.toml --output-dir $OUTPUT_DIR" ""
attach
