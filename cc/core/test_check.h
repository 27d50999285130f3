// A tiny test harness for the memory core's cc_tests (no gtest in this offline build).
// EXPECT_* records a failure and goes on; REQUIRE returns from the test on failure.
#ifndef TF_ANTMAN_CC_CORE_TEST_CHECK_H_
#define TF_ANTMAN_CC_CORE_TEST_CHECK_H_

#include <cstdio>
#include <vector>

namespace antman_test {

struct Case {
  const char* name;
  void (*fn)();
};
inline std::vector<Case>& Cases() {
  static std::vector<Case> cases;
  return cases;
}
inline int& Failures() {
  static int failures = 0;
  return failures;
}
struct Register {
  Register(const char* name, void (*fn)()) { Cases().push_back({name, fn}); }
};

inline int RunAll() {
  int failed_cases = 0;
  for (const Case& c : Cases()) {
    const int before = Failures();
    std::printf("[ RUN  ] %s\n", c.name);
    std::fflush(stdout);
    c.fn();
    const bool ok = Failures() == before;
    failed_cases += !ok;
    std::printf("[ %s ] %s\n", ok ? " OK " : "FAIL", c.name);
  }
  std::printf("%zu cases, %d failed\n", Cases().size(), failed_cases);
  return failed_cases == 0 ? 0 : 1;
}

}  // namespace antman_test

#define TEST(name)                                                   \
  static void name();                                                \
  static antman_test::Register register_##name(#name, &name);        \
  static void name()

#define EXPECT(cond)                                                               \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);     \
      ++antman_test::Failures();                                                   \
    }                                                                              \
  } while (0)

#define EXPECT_EQ(a, b)                                                                   \
  do {                                                                                    \
    const auto va_ = (a);                                                                 \
    const auto vb_ = (b);                                                                 \
    if (!(va_ == vb_)) {                                                                  \
      std::fprintf(stderr, "%s:%d: expected %s == %s (%llu vs %llu)\n", __FILE__, __LINE__, \
                   #a, #b, (unsigned long long)(va_), (unsigned long long)(vb_));         \
      ++antman_test::Failures();                                                          \
    }                                                                                     \
  } while (0)

#define REQUIRE(cond)                                                              \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: required %s\n", __FILE__, __LINE__, #cond);     \
      ++antman_test::Failures();                                                   \
      return;                                                                      \
    }                                                                              \
  } while (0)

// For a checker that returns an empty string when all is well.
#define EXPECT_CLEAN(expr)                                                             \
  do {                                                                                 \
    const std::string why_ = (expr);                                                   \
    if (!why_.empty()) {                                                               \
      std::fprintf(stderr, "%s:%d: invariant broken: %s\n", __FILE__, __LINE__,        \
                   why_.c_str());                                                      \
      ++antman_test::Failures();                                                       \
    }                                                                                  \
  } while (0)

#define TEST_MAIN() \
  int main() { return antman_test::RunAll(); }

#endif  // TF_ANTMAN_CC_CORE_TEST_CHECK_H_
