/* agent_cmd.h - the cflue commands that talk to agentd and start the system. */
#ifndef CFLUE_CLI_AGENT_CMD_H
#define CFLUE_CLI_AGENT_CMD_H

/* cmd_agent runs `cflue submit|watch|status|abort|agents ...`; returns the exit code. */
int cmd_agent(int argc, char **argv);

/* cmd_up runs `cflue up`: starts storaged, toold and agentd, waits until SIGINT/SIGTERM. */
int cmd_up(int argc, char **argv);

#endif
