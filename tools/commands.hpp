// The m3h subcommands; each takes the arguments after its name and returns the exit status.
#pragma once

#include <string>
#include <vector>

namespace m3::tools {

int cmd_compare(const std::vector<std::string>& args);
int cmd_bench(const std::vector<std::string>& args);
int cmd_dump(const std::vector<std::string>& args);
int cmd_golden(const std::vector<std::string>& args);
int cmd_determinism(const std::vector<std::string>& args);
int cmd_train(const std::vector<std::string>& args);
int cmd_sample(const std::vector<std::string>& args);
int cmd_plot(const std::vector<std::string>& args);
int cmd_judge(const std::vector<std::string>& args);
int cmd_export(const std::vector<std::string>& args);
int cmd_import(const std::vector<std::string>& args);
int cmd_logits(const std::vector<std::string>& args);
int cmd_eval(const std::vector<std::string>& args);

}  // namespace m3::tools
