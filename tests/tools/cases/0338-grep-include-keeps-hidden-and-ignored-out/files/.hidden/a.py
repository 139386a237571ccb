needle
