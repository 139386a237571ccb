/* print.h - human-readable output of ledger messages for the cflue command. */
#ifndef CFLUE_CLI_PRINT_H
#define CFLUE_CLI_PRINT_H

#include "cflue/v1/common.pb-c.h"

#include <stdio.h>

/* print_submission writes one submission as "field: value" lines. */
void print_submission(FILE *out, const Cflue__V1__Submission *s);

/* print_record writes one record as a single line: offset, type, submission, body. */
void print_record(FILE *out, const Cflue__V1__Record *r);

#endif
