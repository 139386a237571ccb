/* print.h - human-readable output of ledger messages for the cflue command. */
#ifndef CFLUE_CLI_PRINT_H
#define CFLUE_CLI_PRINT_H

#include "cflue/v1/common.pb-c.h"

#include <stdbool.h>
#include <stdio.h>

/* Longest tool result text print_record shows of a tool_result's first line; the rest is
 * counted ("(N more lines)"). */
#define PRINT_RESULT_MAX 200

/* print_submission writes one submission as "field: value" lines: status and outcome by their
 * lowercase names, times as UTC ISO 8601 (unset ones left out), usage when any. */
void print_submission(FILE *out, const Cflue__V1__Submission *s);

/* print_record writes one record as "OFFSET TYPE SUBMISSION DETAILS" ("-" for no submission),
 * TYPE the body's oneof field name; an assistant message's tool calls follow on lines of their
 * own ("    -> NAME ARGUMENTS"). A record whose body this build does not know prints as
 * "unknown" or "unset". */
void print_record(FILE *out, const Cflue__V1__Record *r);

/* print_status_name returns a submission status's lowercase name ("queued"...). */
const char *print_status_name(Cflue__V1__SubmissionStatus st);

/* print_outcome_name returns an outcome's lowercase name ("completed", "failed", "aborted";
 * "-" when unspecified). */
const char *print_outcome_name(Cflue__V1__Outcome o);

/* print_trigger_name returns a compaction trigger's lowercase name ("threshold"...). */
const char *print_trigger_name(Cflue__V1__CompactionTrigger t);

/* print_result_head writes a tool result's text as print_record shows it: its first line, at
 * most PRINT_RESULT_MAX bytes, then " ..." when more follows; returns the number of lines
 * not shown (0 when the whole text was). */
int print_result_head(FILE *out, const char *text);

#endif
