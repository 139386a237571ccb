/* runner_main.c - toold-runner: the runner of proc.h as a program of its own. */
#include "runner.h"

int main(int argc, char **argv)
{
    return proc_runner_main(argc, argv);
}
