// File helpers of src/core: remove_tree against what is on disk afterwards.
#include "tessera/core/remove_tree.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

namespace tessera {
namespace {

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

void touch(const std::string& path) { std::ofstream(path) << "x"; }

TEST(RemoveTree, RemovesANestedTreeButNotWhatALinkPointsTo) {
  const std::string root = ::testing::TempDir() + "tessera_remove_tree_" + std::to_string(::getpid());
  const std::string outside = root + "_outside";
  ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/a").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/a/b").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(outside.c_str(), 0755), 0);
  touch(root + "/f");
  touch(root + "/a/b/g");
  touch(outside + "/kept");
  ASSERT_EQ(::symlink(outside.c_str(), (root + "/a/link").c_str()), 0);

  std::string error;
  EXPECT_TRUE(remove_tree(root, &error)) << error;
  EXPECT_FALSE(exists(root));
  EXPECT_TRUE(exists(outside + "/kept")) << "the link was followed";

  EXPECT_TRUE(remove_tree(root, &error)) << "a missing path is not an error: " << error;
  touch(root);
  EXPECT_TRUE(remove_tree(root, &error)) << "a plain file: " << error;
  EXPECT_FALSE(exists(root));
  EXPECT_TRUE(remove_tree(outside, &error)) << error;
}

TEST(RemoveTree, ReportsWhatTheSystemRefused) {
  // A path through a file: ENOTDIR, not a crash and not a silent success.
  const std::string file = ::testing::TempDir() + "tessera_remove_tree_file_" + std::to_string(::getpid());
  touch(file);
  std::string error;
  EXPECT_FALSE(remove_tree(file + "/inside", &error));
  EXPECT_NE(error.find("Not a directory"), std::string::npos) << error;
  EXPECT_TRUE(remove_tree(file, &error)) << error;
}

}  // namespace
}  // namespace tessera
