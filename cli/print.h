/* print.h - human-readable output of ledger messages for the cflue command.
 *
 * Text that comes from a model, a tool, a user or a server (answers, tool names, arguments and
 * results, signals, error messages) goes through print_text: a terminal must never receive an
 * escape sequence or a carriage return from it, which could retitle the window, clear the
 * screen, recolour or overwrite what cflue printed. */
#ifndef CFLUE_CLI_PRINT_H
#define CFLUE_CLI_PRINT_H

#include "cflue/v1/common.pb-c.h"

#include <stdbool.h>
#include <stdio.h>

/* Longest tool result text print_record shows of a tool_result's first line; the rest is
 * counted ("(N more lines)"). */
#define PRINT_RESULT_MAX 200

/* Flags of print_text. */
#define PRINT_ONE_LINE 1u /* newlines show as "\n" too, so that the text stays on one line */

/* print_text writes len bytes of text to out with every control character shown visibly
 * instead of acting: C0 controls but newline and tab, and DEL, as "\xNN" (ESC as "\x1b", a
 * carriage return as "\x0d"); C1 controls (U+0080..U+009F, two bytes in UTF-8) as "\uNNNN";
 * a byte that does not belong to a valid UTF-8 sequence as "\xNN". With PRINT_ONE_LINE a
 * newline shows as "\n". Everything else, valid UTF-8 included, is written unchanged. It does
 * so whether or not out is a terminal, so that a file or pipe holds what a terminal shows.
 * Write errors are left in out's error indicator (print_output_ok). */
void print_text(FILE *out, const char *text, size_t len, unsigned flags);

/* print_output_ok flushes out and reports whether every write to it so far succeeded. On the
 * first failure it prints "cflue: cannot write the output: REASON" on stderr, except for EPIPE
 * (the reader went away, as with `| head`), which ends the command quietly as other Unix tools
 * do; the caller then stops (cancels its stream) and exits 1. Idempotent: later calls return
 * false again without printing. */
bool print_output_ok(FILE *out);

/* print_submission writes one submission as "field: value" lines: status and outcome by their
 * lowercase names, times as UTC ISO 8601 (unset ones left out), usage when any; its strings
 * through print_text. */
void print_submission(FILE *out, const Cflue__V1__Submission *s);

/* print_record writes one record as "OFFSET TYPE SUBMISSION DETAILS" ("-" for no submission),
 * TYPE the body's oneof field name; an assistant message's tool calls follow on lines of their
 * own ("    -> NAME ARGUMENTS"). A record whose body this build does not know prints as
 * "unknown" or "unset". Every string of the record goes through print_text (PRINT_ONE_LINE). */
void print_record(FILE *out, const Cflue__V1__Record *r);

/* print_status_name returns a submission status's lowercase name ("queued"...). */
const char *print_status_name(Cflue__V1__SubmissionStatus st);

/* print_outcome_name returns an outcome's lowercase name ("completed", "failed", "aborted";
 * "-" when unspecified). */
const char *print_outcome_name(Cflue__V1__Outcome o);

/* print_trigger_name returns a compaction trigger's lowercase name ("threshold"...). */
const char *print_trigger_name(Cflue__V1__CompactionTrigger t);

/* print_result_head writes a tool result's text as print_record shows it: its first line, at
 * most PRINT_RESULT_MAX bytes (cut before a UTF-8 sequence, not inside it) through print_text,
 * then " ..." when more follows; returns the number of lines not shown (0 when the whole text
 * was). */
int print_result_head(FILE *out, const char *text);

#endif
